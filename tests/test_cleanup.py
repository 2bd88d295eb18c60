"""No probe is left behind after any exit of the tracer: normal, SIGINT,
SIGTERM, SIGHUP (its terminal closed) and kill -9. Probes are perf-event
fds (the uprobe PMU), which the kernel closes with the process; tracefs
must hold no uprobe of ours either. The target keeps running unharmed
throughout."""
import signal
import time

import pytest

from conftest import DDPJob, perf_event_fds, uprobe_events, wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


@pytest.fixture(scope="module")
def running_job(tmp_path_factory):
    """One job for the whole module: every tracer exit below must leave it running."""
    job = DDPJob(tmp_path_factory.mktemp("job"), 2, 0, "--idle-ms", "30", go=False)
    try:
        wait_for(lambda: len(job.truth_records()) >= 3, 90, "the job to be training")
        yield job
    finally:
        job.close()


def steps(job) -> int:
    return len(job.truth_records())


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"])
def test_no_probe_left_after_exit(running_job, tracer, how):
    baseline_fds, baseline_events = perf_event_fds(), uprobe_events()
    t = tracer([running_job.proc.pid], "-q", name=how)
    t.wait_attached(2)
    wait_for(lambda: perf_event_fds() > baseline_fds, 10, "probes to be attached")
    # One uprobe per probe, and (gloo may throw: no uretprobe) one at each
    # return site its callers use, placed on their first call: one at least
    # per rank.
    wait_for(lambda: perf_event_fds() - baseline_fds >=
             sum(e["probes"] for e in t.events("attach")) + 2, 10, "every probe's fds")
    time.sleep(1)
    sig = getattr(signal, how)
    t.proc.send_signal(sig)
    rc = t.wait(30)
    if how == "SIGKILL":
        assert rc == -signal.SIGKILL
    else:
        assert rc == 0, t.output()
        assert t.events("detach")[-1]["reason"] == "signal"
        assert "gloo::allreduce" in t.output(), "no final summary"
    wait_for(lambda: perf_event_fds() == baseline_fds, 10, "perf-event fds to close")
    assert uprobe_events() == baseline_events
    assert running_job.proc.poll() is None, "the job died with the tracer"
    n = steps(running_job)
    wait_for(lambda: steps(running_job) >= n + 5, 60, "the job to keep training")


def test_no_probe_left_after_duration(running_job, tracer):
    baseline = perf_event_fds()
    t = tracer([running_job.proc.pid], "-q", "--duration", "3")
    assert t.wait(60) == 0
    assert t.events("detach")[-1]["reason"] == "duration"
    assert perf_event_fds() == baseline
    assert running_job.proc.poll() is None
