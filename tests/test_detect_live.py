"""Live: attach to a real gloo DDP job, slow one rank down for real with a
cgroup CPU quota, and check that `attach` reports the slowdown soon after
the injection and never before it. Then lift the quota: a recovery."""
import statistics
import time

import pytest

from conftest import wait_for
from greyhound_bpf.inject import CpuQuota, leftover_groups
from harness import unconfirmed_slowdowns

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


FAULT_AFTER_DETECTION_S = 2.0


def iterations(t, rank):
    return [e for e in t.events("iteration") if e["rank"] == rank]


def test_cpu_quota_is_undone_without_leftovers(ddp_job):
    job = ddp_job(2, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 2, 90, "the job to start")
    rank1 = next(p for p in _ranks(job.proc.pid) if p[1] == 1)[0]
    before = leftover_groups()
    q = CpuQuota(rank1, 0.5).apply()
    assert q.limit() == (1000, 2000)
    assert q.group.name in open(f"/proc/{rank1}/cgroup").read()
    q.undo()
    assert leftover_groups() == before
    # Below half a CPU the period grows: the kernel's smallest quota is 1 ms.
    with CpuQuota(rank1, 0.3) as q:
        assert q.limit() == (1000, 3334)
    assert leftover_groups() == before
    assert f"/{q.group.name}" not in open(f"/proc/{rank1}/cgroup").read()


def test_slowdown_detected_after_injection_and_recovery_after_lifting(ddp_job, tracer):
    # A data-loader wait per step leaves the 2-core VM some headroom, so the
    # healthy phase is not slowed by whatever else runs (the tracer itself).
    job = ddp_job(2, 0, "--idle-ms", "10", go=False)
    wait_for(lambda: len(job.truth_records()) >= 2, 90, "the job to start")
    # Detection only: validation's worker start-up (torch imports) would be
    # one more transient on this 2-core VM (tests/test_validate covers it).
    t = tracer([job.proc.pid], "-q", "--no-validate")
    ranks = t.wait_attached(2)
    rank1 = next(r["pid"] for r in ranks if r["rank"] == 1)
    # Healthy phase: the engine locks the pattern and learns the noise.
    wait_for(lambda: len(t.measured(0)) >= 60, 120, "60 healthy iterations", interval=0.5)
    # This 2-core VM has real transients (another test's processes exiting,
    # uprobe teardown): a slowdown in the healthy phase must have ended with
    # a recovery before we inject, or we wait for one.
    def settled():
        changes = [e for e in t.events() if e["kind"] in ("slowdown", "recovery")
                   and e["scope"] == "job"]
        return not changes or changes[-1]["kind"] == "recovery"
    # 0.15 of a CPU, where the rank uses about 0.4 (6 ms of work per 16 ms
    # step): its work runs ~2.5x slower (the 10 ms input wait does not), well
    # clear of the threshold. (A third of a CPU bit anywhere from x1.29 to
    # x2.85 across runs: at x1.29 it took 30 iterations to detect.) A transient may
    # begin in the moment before the injection, its event not yet written
    # when we looked, or not yet detected at all (the fault then extends it,
    # and the change is located at the transient's start; the trainer's own
    # log tells the two apart, see _slow_before): then the premise failed,
    # and we inject again once the job has settled (3 tries).
    for _ in range(3):
        wait_for(settled, 60, "the healthy phase to be settled", interval=0.5, why=t.story)
        with CpuQuota(rank1, 0.15):
            inject_ns = time.time_ns()
            slow = wait_for(lambda: [e for e in t.events("slowdown") if e["scope"] == "job"
                                     and e["time_ns"] >= inject_ns], 90,
                            "a job-level slowdown", interval=0.5, why=t.story)[0]
            # The fault lasts a while past its detection, as a fail-slow
            # does: lifted at once, it was 3-8 slow iterations in CI, and
            # the recovery's before-level mixed them with healthy ones
            # (x0.85, against the x0.8 asserted below).
            time.sleep(FAULT_AFTER_DETECTION_S)
            lifted_at = len(iterations(t, 0))
        rec = wait_for(lambda: [e for e in t.events("recovery")
                                if e["scope"] == "job" and e["index"] >= slow["index"]], 90,
                       "a recovery after the quota is lifted", interval=0.5, why=t.story)[0]
        before = [e for e in t.events() if e["kind"] in ("slowdown", "recovery")
                  and e["scope"] == "job" and e["time_ns"] < inject_ns]
        if (not before or before[-1]["kind"] == "recovery") \
                and not _slow_before(job, t, slow, inject_ns):
            break
    else:
        raise AssertionError("a transient was in progress at each of 3 injections:\n"
                             + t.story())
    assert t.stop() == 0
    # The healthy phase may hold the host's own slowdowns (its log shows
    # them), never one the tool made up.
    assert unconfirmed_slowdowns(t.events(), job.truth_records(), 0, inject_ns) == [], \
        t.story()
    its = {e["index"]: e for e in iterations(t, 0)}
    # The change located at the injection (the boundary of a change is
    # uncertain by a few iterations: the median-of-3 filter and the BOCD's
    # MAP start), and found within 15 iterations of it.
    assert its[slow["index"]]["start_ns"] > inject_ns - 5 * its[slow["index"]]["dur_ns"]
    first_slow = min(i for i, e in its.items() if e["start_ns"] + e["dur_ns"] > inject_ns)
    assert slow["detected_index"] - first_slow <= 15
    assert slow["ratio"] > 1.25 and rec["ratio"] < 1 / 1.25
    assert rec["index"] >= lifted_at - 15
    assert "SLOWDOWN job" in t.output() and "RECOVERY job" in t.output()


def _slow_before(job, t, slow, inject_ns) -> bool:
    """True when the change was located well before the injection and the
    job's own log (the trainer's ground truth, not the probes) shows those
    iterations really were slower than the ones before: a host transient,
    not yet reported when we injected, that the fault then extended. Then
    the premise failed and the test injects again. If they were not slower,
    the detector placed the change wrongly: False, and the test fails."""
    its = {e["index"]: e for e in iterations(t, 0)}
    onset = its[slow["index"]]["start_ns"]
    if onset > inject_ns - 5 * its[slow["index"]]["dur_ns"]:
        return False
    truth = [r for r in job.truth_records() if r["rank"] == 0]
    base = [r["dur_ns"] for r in truth if r["start_ns"] < onset][-30:]
    gap = [r["dur_ns"] for r in truth if onset <= r["start_ns"] < inject_ns]
    if len(base) < 10 or not gap:
        return False
    return statistics.median(gap) > 1.1 * statistics.median(base)


def _ranks(pid):
    from greyhound_bpf.probe.discovery import all_stats, descendants, rank_identity
    return [(p, rank_identity(p)[0]) for p in descendants([pid], all_stats()) if p != pid]
