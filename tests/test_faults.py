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


@pytest.mark.bpf
@pytest.mark.slow
def test_two_attach_on_one_control_file(ddp_job, tracer, tmp_path):
    """One writer per control file: the second `attach --mitigate` says so
    and advises only; once the first is gone, a third one writes."""
    ctl = tmp_path / "ctl.json"
    job = ddp_job(2, 0, "--control-file", str(ctl), go=False)
    wait_for(lambda: len(job.truth_records()) >= 10, 90, "the job to train")
    first = tracer([job.proc.pid], "-q", "--control-file", str(ctl), "--mitigate",
                   "--no-validate", name="first")
    first.wait_attached(2)
    second = tracer([job.proc.pid], "-q", "--control-file", str(ctl), "--mitigate",
                    "--no-validate", name="second")
    second.wait_attached(2)
    assert f"(pid {first.proc.pid}) writes plans to {ctl}: advising only" in second.output()
    assert "advising only" not in first.output()
    assert second.stop() == 0
    first.proc.kill()                          # kill -9: the kernel drops the lock
    first.wait(30)
    third = tracer([job.proc.pid], "-q", "--control-file", str(ctl), "--mitigate",
                   "--no-validate", name="third")
    third.wait_attached(2)
    assert "advising only" not in third.output()
    assert third.stop() == 0
