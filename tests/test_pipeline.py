"""S3 for real: scripts/pipeline_train.py, a GPipe schedule over gloo
send/recv (2 stages x 2 data-parallel replicas), follows a reconfigure_pipeline
plan through greyhound-run: it checkpoints, relaunches with the new layer
split, every block's parameters move to the stage that now holds it, and
the losses continue exactly as an uninterrupted run's."""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import (BIN, ROOT, free_port, kill_tree, mitigating_healthy, rank_pids,
                     read_jsonl, under_fault_from, wait_for)
from mitigation.control import ControlWriter

pytestmark = pytest.mark.slow
TRAINER = ROOT / "scripts" / "pipeline_train.py"
STEPS = 12
COMMON = ("--pp", "2", "--blocks", "8", "--hidden", "64", "--microbatches", "4",
          "--idle-ms", "50", "--seed", "5")


def launch(work: Path, *args: str, prefix: list[str] = ()) -> subprocess.Popen:
    out = open(work / "job.out", "w")
    cmd = [*prefix, str(BIN / "torchrun"), "--nproc-per-node",
           "{nproc}" if prefix else "4", "--master-port", str(free_port()), str(TRAINER),
           "--steps", str(STEPS), "--truth", str(work / "truth.jsonl"), *COMMON, *args]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def losses(truth: Path) -> dict[tuple[int, int], float]:
    out = {}
    for d in read_jsonl(truth):
        if "loss" in d:
            assert (d["rank"], d["index"]) not in out, "a step ran twice"
            out[d["rank"], d["index"]] = d["loss"]
    return out


def test_a_resplit_moves_the_layers_and_the_losses_continue(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    base.mkdir()
    run.mkdir()
    p = launch(base)
    try:
        assert p.wait(timeout=240) == 0, (base / "job.out").read_text()[-3000:]
    finally:
        kill_tree(p)
    ctl = run / "ctl.json"
    sup = [str(Path(sys.executable).parent / "greyhound-run"), "--control-file", str(ctl),
           "--nproc", "4", "--"]
    p = launch(run, "--control-file", str(ctl), "--checkpoint", str(run / "ckpt"), prefix=sup)
    try:
        wait_for(lambda: sum("loss" in d for d in read_jsonl(run / "truth.jsonl")) >= 8, 180,
                 "the pipeline to train")
        acks = ControlWriter(ctl).ack_docs()
        assert {r: (a["stage"], a["layer_split"]) for r, a in acks.items()} == \
            {0: (0, [4, 4]), 1: (1, [4, 4]), 2: (0, [4, 4]), 3: (1, [4, 4])}
        assert all("microbatches" not in a for a in acks.values())   # not to be rebalanced
        ControlWriter(ctl).issue("reconfigure_pipeline", layer_split=[6, 2], reason="test",
                                 restart={"checkpoint": True})
        assert p.wait(timeout=240) == 0, (run / "job.out").read_text()[-3000:]
    finally:
        kill_tree(p)
    recs = read_jsonl(run / "truth.jsonl")
    splits = {(d["rank"], d["index"]): d["layer_split"] for d in recs if "layer_split" in d}
    assert {tuple(v) for v in splits.values()} == {(4, 4), (6, 2)}
    first_new = min(i for (_, i), v in splits.items() if v == [6, 2])
    assert all(v == ([6, 2] if i >= first_new else [4, 4]) for (_, i), v in splits.items())
    assert sorted(d["exit_code"] for d in recs if d.get("final")) == [0] * 4 + [75] * 4
    a, b = losses(base / "truth.jsonl"), losses(run / "truth.jsonl")
    assert set(a) == set(b) == {(r, i) for r in (1, 3) for i in range(STEPS)}
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), k


@pytest.mark.bpf
def test_a_slowed_stage_is_resplit_live_and_the_job_runs_faster(tmp_path, tracer):
    """The pipeline under greyhound-run, each rank pinned to a CPU (stage 0
    on one, stage 1 on the other), `attach --mitigate`. Healthy for 10 s:
    no verdict, no plan. Then rank 1 (stage 1) gets 0.15 CPU, and again
    after the relaunch (the slow device stays where stage 1's rank 1 runs):
    the slowdown is named, a reconfigure_pipeline plan gives stage 1 fewer
    blocks, greyhound-run relaunches with it, and the job runs within 25%
    of the plan's prediction and at least 10% faster than while slowed on
    the old split (outside Greyhound's own activity)."""
    from greyhound_bpf.inject import CpuQuota
    ctl = tmp_path / "ctl.json"
    sup = [str(Path(sys.executable).parent / "greyhound-run"), "--control-file", str(ctl),
           "--nproc", "4", "--"]
    out = open(tmp_path / "job.out", "w")
    p = subprocess.Popen([*sup, str(BIN / "torchrun"), "--nproc-per-node", "{nproc}",
                          "--master-port", str(free_port()), str(TRAINER), "--pin",
                          "--blocks", "8", "--hidden", "256", "--mb-size", "64",
                          "--microbatches", "4", "--control-file", str(ctl),
                          "--checkpoint", str(tmp_path / "ckpt"),
                          "--truth", str(tmp_path / "truth.jsonl")],
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    quotas = []
    try:
        first, t = mitigating_healthy(tracer, p.pid, 4, ctl, 10)
        slow_from = time.time_ns()
        quotas.append(CpuQuota(first[1], 0.15))
        quotas[-1].apply()
        plan = wait_for(lambda: next((e for e in t.events("action")
                                      if e["strategy"] == "reconfigure_pipeline"), None),
                        120, "a re-split")
        split = plan["plan"]["layer_split"]
        assert sum(split) == 8 and split[1] < 4, plan
        # Once the relaunched job trains (a quota during its start-up would
        # only slow its torch import), its rank 1 gets the slow device too.
        wait_for(lambda: any(d.get("layer_split") == split
                             for d in read_jsonl(tmp_path / "truth.jsonl")), 180,
                 "the relaunched pipeline to train")
        second = rank_pids(p.pid)
        assert second[1] != first[1]
        quotas.append(CpuQuota(second[1], 0.15))
        quotas[-1].apply()
        resplit_from = time.time_ns()
        time.sleep(12)
        assert t.stop() == 0
    finally:
        for q in quotas:
            q.undo()
        kill_tree(p)
    # Doing nothing is the slowed job on [4, 4], less the iterations that
    # overlap Greyhound's own activity (validation workers, the pause): they
    # are its cost, not the fault's.
    spans = [(e["start_ns"], e["end_ns"]) for e in t.events("activity") if e["end_ns"]]
    recs = [d for d in read_jsonl(tmp_path / "truth.jsonl") if d.get("rank") == 0
            and "dur_ns" in d and not any(d["start_ns"] < hi and lo < d["start_ns"] + d["dur_ns"]
                                          for lo, hi in spans)]
    # From 1 s after the quota (its first periods): the time after that is
    # the fault's, but for Greyhound's own activity, left out above (in CI
    # the workers' start and the pause took 9.8 of the 15 s to the re-split,
    # and 5 s in left 5 and 6 slowed iterations).
    under_from = under_fault_from(slow_from, plan["time_ns"], settle_s=1.0)
    slowed = [d["dur_ns"] / 1e6 for d in recs if d["layer_split"] == [4, 4]
              and under_from <= d["start_ns"] < plan["time_ns"]]
    after = [d["dur_ns"] / 1e6 for d in recs if d["layer_split"] == split
             and d["start_ns"] >= resplit_from + 5e9]
    # A plan that comes quickly leaves few slowed iterations before it (in a
    # CI run on a host twice as loaded: 9 of 305-380 ms, in 3 s): five are
    # enough for a median that the 10% margin below can be held to.
    assert len(slowed) >= 5 and len(after) >= 30, (len(slowed), len(after))
    s, a, want = statistics.median(slowed), statistics.median(after), plan["expected_ms"]
    print(f"pipeline: slowed {s:.1f} ms on [4, 4], {a:.1f} ms on {split} "
          f"(predicted {want:.1f} ms)")
    # How much a re-split can gain depends on how hard the quota bites in
    # this run (slowed 104-162 ms over CI runs), which the test does not
    # control: so the re-split is held to its own prediction, within the
    # spread of single rounds the README reports (-13% to +20%), and must
    # beat doing nothing by a clear margin.
    assert a <= 1.25 * want, (s, a, want, split)
    assert a < 0.9 * s, (s, a, want, split)
    assert "with layers per stage" in (tmp_path / "job.out").read_text()
