"""Bad input gets one clear line and a non-zero exit, never a traceback: a PID
that does not exist, a target without the libraries, not being root, bad
arguments, and a BCC that cannot be imported."""
import os
import subprocess
import sys

import pytest

from conftest import run_cli as run


def one_line_error(proc, code: int, needle: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


def unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        pid = int(fh.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


@pytest.mark.bpf
def test_pid_that_does_not_exist():
    pid = unused_pid()
    one_line_error(run("attach", str(pid)), 2, f"no process with PID {pid}")


@pytest.mark.bpf
def test_target_without_the_libraries():
    p = subprocess.Popen(["sleep", "60"])
    try:
        line = one_line_error(run("attach", str(p.pid)), 2, "map none of")
        assert "libnccl.so*" in line and "--wait" in line
    finally:
        p.kill()
        p.wait()


@pytest.mark.bpf
def test_wait_for_a_target_that_never_loads_them_stops_at_duration(tmp_path):
    p = subprocess.Popen(["sleep", "60"])
    try:
        out = run("attach", str(p.pid), "--wait", "--duration", "2", "-o", str(tmp_path / "e"))
        assert out.returncode == 0, out.stderr
        assert "waiting for ranks" in out.stderr
    finally:
        p.kill()
        p.wait()


@pytest.mark.bpf
def test_not_root():
    p = subprocess.Popen(["sleep", "60"])
    try:
        out = run("attach", str(p.pid), user="65534")
        one_line_error(out, 1, "needs root")
        assert "sudo" in out.stderr
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("args,needle", [
    (["attach", "abc"], "not a PID: 'abc'"),
    (["attach", "-5"], "not a PID"),
    (["attach", "1", "--duration", "0"], "must be positive"),
    (["attach"], "give the PID of a rank or of its launcher"),
    (["replay", "x.jsonl", "--min-probability", "2"], "must be at most 1"),
    (["attach", "1", "--threshold", "-0.1"], "must be positive"),
])
def test_bad_arguments(args, needle):
    out = run(*args)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr


@pytest.mark.bpf
def test_ringbuf_pages_must_be_a_power_of_two():
    p = subprocess.Popen([sys.executable, "-c", "import torch, time; time.sleep(60)"])
    try:
        from conftest import wait_for
        from greyhound_bpf.probe.catalog import load_catalog
        from greyhound_bpf.probe.discovery import mapped_libraries
        wait_for(lambda: mapped_libraries(p.pid, load_catalog()), 30, "torch to load")
        one_line_error(run("attach", str(p.pid), "--ringbuf-pages", "3"), 2, "power of two")
    finally:
        p.kill()
        p.wait()


def test_bcc_missing_points_to_check(monkeypatch):
    """A broken BCC install is an environment error that names the fix."""
    from greyhound_bpf import GreyhoundError
    from greyhound_bpf.probe.tracer import import_bcc
    monkeypatch.setitem(sys.modules, "bcc", None)
    with pytest.raises(GreyhoundError) as e:
        import_bcc()
    assert e.value.exit_code == 1
    assert "python3-bpfcc" in str(e.value) and "greyhound-trace check" in str(e.value)


def test_help_has_examples():
    out = run("attach", "--help")
    assert out.returncode == 0
    assert "examples:" in out.stdout and "sudo greyhound-trace attach 4242" in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_json_is_a_switch_and_never_takes_a_pid():
    """`attach -j 4242 4243` (bcc tools' habit) traces both PIDs on stdout;
    a file is `-o FILE`; `-p PID` is bcc's spelling of a target."""
    from greyhound_bpf.cli import _json_target, build_parser
    p = build_parser()
    a = p.parse_args(["attach", "-j", "4242", "4243"])
    assert (a.pids, a.json, _json_target(a)) == ([4242, 4243], True, "-")
    a = p.parse_args(["attach", "-p", "4242", "-o", "ev.jsonl", "4243", "-p", "4244"])
    assert (a.pids, a.more_pids, _json_target(a)) == ([4243], [4242, 4244], "ev.jsonl")
    for cmd in (["validate", "-j", "4242"], ["replay", "-j", "run.rec.gz"]):
        a = p.parse_args(cmd)
        assert a.json is True and a.output is None, cmd


@pytest.mark.parametrize("spec, want", [("9400", ("127.0.0.1", 9400)),
                                        (":9400", ("127.0.0.1", 9400)),
                                        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
                                        ("[::1]:0", ("::1", 0))])
def test_metrics_listen_address(spec, want):
    from greyhound_bpf.cli import build_parser
    assert build_parser().parse_args(["attach", "1", "--metrics", spec]).metrics == want


@pytest.mark.parametrize("spec", ["x", "127.0.0.1:", "1:70000"])
def test_bad_metrics_address(spec):
    out = run("attach", "1", "--metrics", spec)
    assert out.returncode == 2 and "--metrics" in out.stderr and "Traceback" not in out.stderr


def test_timestamps_on_every_text_line():
    import io
    import re
    from greyhound_bpf.output.console import Terminal
    out = io.StringIO()
    Terminal(out, io.StringIO(), timestamps=True).tell("rank 0 ...\nrank 1 ...")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(re.match(r"\d\d:\d\d:\d\d rank \d", x) for x in lines)
    assert Terminal(io.StringIO(), io.StringIO()).stamp("x") == "x"
