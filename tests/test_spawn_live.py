"""Live, on a job launched as PyTorch's DDP tutorial launches it
(examples/spawn_ddp.py: torch.multiprocessing.spawn, each rank told its
rank as an argument, no RANK in any environment), attached through the
script's PID, as a user would:

1. Each rank is found once and numbered as the job numbers itself (its own
   log says which pid is which rank); the script is the launcher.
2. A healthy phase: every rank's iterations, nothing named, no plan, and no
   job slowdown that the job's own log does not show.
3. Rank 1 under a CPU quota: named (computation, rank 1), nothing else.
Each phase runs once (no retries)."""
import os
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from greyhound_bpf.inject import CpuQuota
from harness import (ROOT, JsonlTail, cpu_share, free_port, kill_tree, named,
                     unconfirmed_slowdowns, wrong)

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def test_an_mp_spawn_job_through_its_scripts_pid(tmp_path, tracer):
    truth = tmp_path / "truth.jsonl"
    job = subprocess.Popen([sys.executable, str(ROOT / "examples" / "spawn_ddp.py"), "--world",
                            "3", "--port", str(free_port()), "--truth", str(truth)],
                           stdout=open(tmp_path / "job.out", "w"), stderr=subprocess.STDOUT,
                           start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        log = JsonlTail(truth)
        records: list[dict] = []

        def pids():
            records.extend(log.read())
            got = {r["rank"]: r["pid"] for r in records}
            return got if len(got) == 3 and len(records) >= 60 else None
        pid_of = wait_for(pids, 120, "three ranks training", interval=0.2)
        t = tracer([job.pid], "-q", name="spawn")
        attached = t.wait_attached(3)
        attach_ns = t.events("attach")[0]["time_ns"]
        # 1. The ranks, as the job numbers them; the script is no rank.
        assert {r["pid"]: r["rank"] for r in attached} == {p: r for r, p in pid_of.items()}
        assert all(r["rank_from"] == "spawn order" and r["world_size"] == 3 for r in attached)
        assert job.pid not in {r["pid"] for r in attached}
        assert "rank 1 (mp.spawn's order" in t.output(), t.output()
        # 2. Healthy.
        time.sleep(10)
        assert {e["rank"] for e in t.events("iteration")} == {0, 1, 2}, t.story()
        assert named(t) == [], t.story()
        assert [e for e in t.events("action") if e["strategy"] != "none"] == [], t.story()
        # 3. Rank 1 slowed.
        used = cpu_share(pid_of[1], 2)
        with CpuQuota(pid_of[1], max(0.02, 0.3 * used)):
            inject_ns = time.time_ns()
            wait_for(lambda: named(t, inject_ns), 30, "the straggler named", interval=0.25,
                     why=t.story)
            assert wrong(named(t), 1) == [], t.story()
        records.extend(log.read())
        assert unconfirmed_slowdowns(t.events(), records, attach_ns, inject_ns) == [], t.story()
        assert t.stop() == 0
    finally:
        kill_tree(job)
