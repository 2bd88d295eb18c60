"""Greyhound under its own faults (issue #18's table), each row for real.
Rows tested elsewhere: SIGHUP of the demo (test_demo.py) and of the tracer
(test_cleanup.py), kill -9 of the tracer during a pause (test_validate.py's
watchdog), kill -9 of inject (test_inject.py), a hostile recording
(test_replay.py), a malformed control file (test_control.py)."""
import subprocess

import pytest

from conftest import run_cli, wait_for
from greyhound_bpf.output.jsonl import JsonLinesWriter


def test_events_to_a_full_device_are_counted_not_fatal():
    w = JsonLinesWriter("/dev/full")               # every write: ENOSPC
    for i in range(5000):
        w.write({"kind": "iteration", "index": i, "pad": "x" * 40})
    w.flush()
    w.close()
    assert w.error == "No space left on device" and w.dropped == 5000 and w.closed


@pytest.mark.bpf
@pytest.mark.slow
def test_a_full_disk_under_json_and_record(ddp_job, tmp_path):
    """-o and --record on a 64 KiB tmpfs that fills up: one line each, the
    tracer goes on to its --duration and its summary, the lost output is
    counted, and the job is unharmed."""
    job = ddp_job(2, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 10, 90, "the job to train")
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        r = run_cli("attach", str(job.proc.pid), "-o", str(disk / "ev.jsonl"), "--calls",
                    "--record", str(disk / "run.rec"), "--duration", "25", "-q",
                    "--no-validate", timeout=120)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    said = [line for line in out.splitlines() if "No space left on device" in line]
    # Said once for each output when it fails, and counted in the summary.
    assert sum("events are not written from now on" in line for line in said) == 1, said
    assert sum("recording stopped (tracing goes on)" in line for line in said) == 1, said
    assert any("event(s) not written" in line for line in said), said
    assert any("input(s) not recorded" in line for line in said), said
    # Tracing went on to the end: the final summary counts the job's calls.
    assert "gloo::allreduce" in out and "calls traced in" in out
    assert job.proc.poll() is None
