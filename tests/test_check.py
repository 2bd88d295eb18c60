"""`greyhound-trace check`: a table of requirements, the fix for each failing
line, exit 0 when tracing can work and 1 otherwise."""
import subprocess
import sys

import pytest

from conftest import nccl_lib, run_cli
from greyhound_bpf.probe.check import FAIL, OK, Row, check_headers, exit_code, render


def run(*args, user=None):
    return run_cli("check", *args, user=user, env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})


@pytest.mark.bpf
def test_check_passes_as_root_and_loads_the_program():
    out = run()
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in ("kernel: uprobes + BPF", "tracefs", "kernel headers", "bcc", "privileges",
                   "BPF program", "compiles and loads", "tracing can work"):
        assert needle in out.stdout


@pytest.mark.bpf
def test_check_reports_libraries_of_a_pid():
    p = subprocess.Popen([sys.executable, "-c",
                          f"import ctypes, time; ctypes.CDLL({nccl_lib()!r}); "
                          "print('up', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True,
                         env={"RANK": "5", "WORLD_SIZE": "8", "PATH": "/usr/bin:/bin"})
    try:
        assert p.stdout.readline().strip() == "up"
        out = run("--pid", str(p.pid), "--no-load")
        assert out.returncode == 0, out.stdout
        assert f"pid {p.pid}" in out.stdout and "rank 5" in out.stdout
        assert "libnccl.so.2" in out.stdout
    finally:
        p.kill()
        p.wait()


@pytest.mark.bpf
def test_check_fails_for_a_pid_without_libraries():
    p = subprocess.Popen(["sleep", "60"])
    try:
        out = run("--pid", str(p.pid), "--no-load")
        assert out.returncode == 1
        assert "FAIL" in out.stdout and "maps none of" in out.stdout
    finally:
        p.kill()
        p.wait()


def test_check_as_unprivileged_user_fails_with_the_fix():
    out = run("--no-load", user="65534")
    assert out.returncode == 1, out.stdout
    assert "privileges" in out.stdout and "run with sudo" in out.stdout
    assert "cannot work" in out.stdout


def test_missing_headers_give_the_setup_command(monkeypatch, tmp_path):
    monkeypatch.setattr("platform.release", lambda: "0.0.0-nonexistent")
    row = check_headers()
    assert row.status == FAIL and "scripts/setup" in row.fix


def test_render_and_exit_code():
    from rich.console import Console
    rows = [Row("a", OK, "fine"), Row("b", FAIL, "broken", "do this")]
    con = Console(width=80, record=True, force_terminal=False, color_system=None)
    con.print(render(rows))
    text = con.export_text()
    assert "fix: do this" in text and "FAIL" in text
    assert exit_code(rows) == 1 and exit_code(rows[:1]) == 0
