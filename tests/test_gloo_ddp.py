"""Real PyTorch DDP over gloo on the CPU, under torchrun, traced through the
torchrun PID: every rank is found with its rank id, and the per-rank
gloo::allreduce counts equal the job's own counts, but for the first call
from each caller, which may begin before that caller's return site is
probed (gloo may throw, so it gets no uretprobe: probes/greyhound.h); the
tracer counts those (`untimed`)."""
import bisect
import statistics
import time
from collections import Counter

import pytest

from conftest import wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


@pytest.mark.parametrize("nproc,named", [(2, "rank 1"), (4, "torchrun")])
def test_ddp_ranks_and_allreduce_counts(ddp_job, tracer, nproc, named):
    job = ddp_job(nproc, 30)
    # torchrun imports torch (it maps libtorch_cpu) but is a launcher: the
    # tracer starts at once and waits for its ranks.
    wait_for(lambda: job.proc.poll() is None and len(_children(job.proc.pid)) >= nproc, 60,
             "torchrun workers")
    pid = job.proc.pid
    if named == "rank 1":
        # A user who names one rank means its job: every rank is traced.
        from greyhound_bpf.probe.discovery import rank_identity
        pid = wait_for(lambda: next((p for p in _children(job.proc.pid)
                                     if rank_identity(p)[0] == 1), None), 60, "rank 1")
    t = tracer([pid], "--calls", "-q")
    ranks = t.wait_attached(nproc, timeout=90)
    attach = t.events("attach")[0]
    assert (attach["pid"], attach["named"]) == (job.proc.pid, [pid])
    if named == "rank 1":
        assert f"pid {pid} is rank 1 of 2, under torchrun (pid {job.proc.pid})" in t.output()
    assert sorted(r["rank"] for r in ranks) == list(range(nproc))
    assert all(r["world_size"] == nproc and r["local_rank"] == r["rank"] for r in ranks)
    assert job.proc.pid not in {r["pid"] for r in ranks}, "torchrun is a launcher, not a rank"
    assert all("gloo" in r["libraries"] for r in ranks)
    job.go()
    assert job.wait(180) == 0
    assert t.wait(60) == 0, t.output()

    final = job.final_counts()
    assert sorted(final) == list(range(nproc))
    calls = t.events("call")
    _assert_counts(t, final, nproc)

    # Durations are positive and shorter than the job's own step that holds them.
    truth = job.truth_records()
    for r in range(nproc):
        steps = sorted((s["start_ns"], s["start_ns"] + s["dur_ns"]) for s in truth if s["rank"] == r)
        starts = [s for s, _ in steps]
        checked = 0
        for c in calls:
            if c["rank"] != r or c["fn"] != "gloo::allreduce":
                continue
            assert c["dur_ns"] > 0
            i = bisect.bisect_right(starts, c["start_ns"]) - 1
            if i >= 0 and c["start_ns"] + c["dur_ns"] <= steps[i][1] + 5_000_000:
                assert c["dur_ns"] < steps[i][1] - steps[i][0]
                checked += 1
        assert checked >= final[r]["allreduces"] * 0.9, "calls do not fall inside the job's steps"
    detach = t.events("detach")[-1]
    assert detach["reason"] == "target_exited" and detach["lost"] == 0
    assert {e["pid"] for e in t.events("exit")} == {r["pid"] for r in ranks}


def test_attach_mid_run_sees_calls_within_2s(ddp_job, tracer):
    job = ddp_job(2, 0, go=False)      # trains until killed
    wait_for(lambda: len(job.truth_records()) >= 5, 90, "the job to be training")
    t = tracer([job.proc.pid], "--calls", "-q")
    t.wait_attached(2, timeout=60)
    attach_ns = t.events("attach")[0]["time_ns"]
    first = wait_for(lambda: t.events("call"), 10, "the first call event")[0]
    assert first["start_ns"] - attach_ns < 2e9
    assert t.stop() == 0
    assert t.events("detach")[-1]["reason"] == "signal"
    assert job.proc.poll() is None, "the job must keep running after the tracer leaves"
    n = len(job.truth_records())
    wait_for(lambda: len(job.truth_records()) > n + 3, 30, "the job to keep training")


def test_a_one_bucket_job_gets_its_iterations(ddp_job, tracer):
    # A small model: its gradients fit one DDP bucket, one all-reduce per
    # step and no other call. Each call is an iteration.
    job = ddp_job(2, 0, "--hidden", "128", "--layers", "3", "--bucket-mb", "25", go=False)
    wait_for(lambda: len(job.truth_records()) >= 5, 90, "the job to be training")
    t = tracer([job.proc.pid], "-q", "--no-validate")
    t.wait_attached(2, timeout=60)
    wait_for(lambda: all(len(t.measured(r)) >= 100 for r in (0, 1)), 60,
             "100 iterations per rank", interval=0.5, why=t.story)
    assert t.stop() == 0
    truth = job.truth_records()
    assert truth[-1]["allreduces"] - truth[0]["allreduces"] == truth[-1]["index"] - \
        truth[0]["index"], "the job must make one all-reduce per step"
    assert {(e["rank"], e["period_calls"]) for e in t.events("pattern")} == {(0, 1), (1, 1)}
    for r in (0, 1):
        # Over the same span: before the attach the job ran without the
        # probes' cost (a 1.7 ms step notices it).
        ms = t.measured(r)
        lo, hi = ms[0]["start_ns"], ms[-1]["start_ns"] + ms[-1]["dur_ns"]
        starts = [s["start_ns"] for s in truth if s["rank"] == r and lo <= s["start_ns"] <= hi]
        # Means over the same steps: the medians of a 1.7 ms step's two
        # series read 1.49 against 1.75 ms in a clean-clone CI run.
        step_ms = (starts[-1] - starts[0]) / (len(starts) - 1) / 1e6
        ours = statistics.mean(e["dur_ns"] for e in ms) / 1e6
        assert abs(ours - step_ms) <= 0.1 * step_ms, (r, ours, step_ms)


def test_ranks_that_start_after_the_attach(ddp_job, tracer):
    # A shell launcher that maps nothing at first: --wait waits for ranks.
    job = ddp_job(2, 20, prefix=["bash", "-c", 'sleep 3; exec "$@"', "launcher"])
    t = tracer([job.proc.pid], "--wait", "--calls", "-q")
    t0 = time.time_ns()
    ranks = t.wait_attached(2, timeout=90)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert min(e["time_ns"] for e in t.events("attach") if e["ranks"]) - t0 > 2.5e9
    job.go()
    assert job.wait(120) == 0
    assert t.wait(60) == 0
    _assert_counts(t, job.final_counts(), 2)


def _assert_counts(t, final: dict, nproc: int) -> None:
    seen = Counter(c["rank"] for c in t.events("call") if c["fn"] == "gloo::allreduce")
    missed = {r: final[r]["allreduces"] - seen[r] for r in range(nproc)}
    detach = t.events("detach")[-1]
    assert all(m >= 0 for m in missed.values()), missed
    # Only calls that began before their site was probed can be missing:
    # those of the few milliseconds before the tracer places the probe
    # (broadcasts at DDP's start included), a handful per rank.
    assert sum(missed.values()) <= detach["untimed"] <= 10 * nproc, (missed, detach)
    assert all(final[r]["allreduces"] > 20 for r in range(nproc))


def _children(pid: int) -> list[int]:
    from greyhound_bpf.probe.discovery import all_stats, descendants
    return [p for p in descendants([pid], all_stats()) if p != pid]


def test_sends_and_receives_returning_to_one_instruction_are_timed(ddp_job, tracer):
    """Decentralized SGD (examples/gossip_sgd.py) waits on its isend's and
    irecv's works from one Python line: SendWork::wait and RecvWork::wait
    both return to one instruction (inside Work::wait), so one uprobe there
    times both. The second function's calls were counted as untimed for as
    long as the job ran (half of all its calls), though every one of them
    was timed; now only the few before the probe is placed are."""
    job = ddp_job(2, 0, trainer="gossip", go=False)
    t = tracer([job.proc.pid], "--calls", "-q")
    t.wait_attached(2, timeout=90)
    wait_for(lambda: len(t.events("call")) >= 600, 90, "the job's sends and receives")
    assert t.stop() == 0
    calls = Counter((c["rank"], c["fn"]) for c in t.events("call"))
    assert all(calls[r, f] >= 100 for r in (0, 1)
               for f in ("gloo::send_wait", "gloo::recv_wait")), calls
    assert t.events("detach")[-1]["untimed"] <= 10 * 2, t.events("detach")


def test_a_scatter_is_timed(ddp_job, tracer):
    """dist.scatter over gloo (examples/scatter_batches.py: rank 0's input
    pipeline sends each rank its shard, two scatters a step): every rank's
    scatters are timed, and rank 1 waits in them for rank 0's augmentation
    longer than rank 0, the source, does."""
    job = ddp_job(2, 0, trainer="scatter", go=False)
    t = tracer([job.proc.pid], "--calls", "-q", "--no-validate")
    t.wait_attached(2, timeout=90)
    wait_for(lambda: sum(c["fn"] == "gloo::scatter" for c in t.events("call")) >= 200, 90,
             "the job's scatters")
    assert t.stop() == 0
    calls = [c for c in t.events("call") if c["fn"] == "gloo::scatter"]
    per = Counter(c["rank"] for c in calls)
    assert all(per[r] >= 80 for r in (0, 1)), per
    waited = {r: sum(c["dur_ns"] for c in calls if c["rank"] == r) / per[r] for r in (0, 1)}
    assert waited[1] > 1.5 * waited[0], waited
