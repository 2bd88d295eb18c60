"""A target making more probed calls than a small ring buffer can hold: the
loss is counted in the kernel and reported as `lost` events, delivered plus
lost equals the calls made, and the tracer stays responsive."""
import os
import signal
import subprocess
import time

import pytest

from conftest import nccl_lib, wait_for

pytestmark = pytest.mark.bpf

LOOPS, THREADS = 150_000, 2       # ncclGroupStart + ncclGroupEnd per loop


def test_lost_records_are_counted_and_reported(ghbench, tracer):
    env = dict(os.environ, GH_BENCH_WAIT="1", GH_NCCL_LIB=nccl_lib())
    target = subprocess.Popen([str(ghbench), "nccl", str(LOOPS), str(THREADS)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        # One 4 KiB page holds ~40 records.
        t = tracer([target.pid], "--ringbuf-pages", "1", "-q")
        t.wait_attached(1)
        target.stdin.write("go\n")
        target.stdin.flush()
        calls, ns_per_loop, elapsed_ns = target.stdout.readline().split()
        made = int(calls) * 2
        rate = made / (float(elapsed_ns) / 1e9)
        assert target.wait(30) == 0
        assert t.wait(30) == 0, t.output()
    finally:
        if target.poll() is None:
            target.kill()
    print(f"target made {rate:.0f} probed calls/s")
    assert rate > 200_000, f"target made only {rate:.0f} probed calls/s"
    lost = t.events("lost")
    assert lost, "no lost events although the ring buffer overflowed"
    detach = t.events("detach")[-1]
    assert sum(e["count"] for e in lost) == detach["lost"] > 0
    assert detach["delivered"] + detach["lost"] == made
    assert lost[-1]["total"] == detach["lost"]
    assert "records lost" in t.output()


def test_tracer_stays_responsive_under_overload(ghbench, tracer):
    env = dict(os.environ, GH_BENCH_WAIT="1", GH_NCCL_LIB=nccl_lib())
    target = subprocess.Popen([str(ghbench), "nccl", "100000000", str(THREADS)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        t = tracer([target.pid], "--ringbuf-pages", "1", "-i", "0.5")
        t.wait_attached(1)
        target.stdin.write("go\n")
        target.stdin.flush()
        # Interval summaries keep coming while the probes fire flat out.
        wait_for(lambda: t.output().count("CALLS/S") >= 4, 20, "interval summaries")
        wait_for(lambda: t.events("lost"), 10, "a lost event")
        start = time.monotonic()
        assert t.stop(signal.SIGTERM) == 0
        assert time.monotonic() - start < 5, "slow to stop under load"
        assert t.events("detach")[-1]["reason"] == "signal"
        assert target.poll() is None, "the target must survive the tracer"
    finally:
        target.kill()
        target.wait()
