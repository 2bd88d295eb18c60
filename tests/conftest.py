"""Shared fixtures: real targets (ctypes NVIDIA calls, torchrun gloo DDP, a C
tight loop) and a runner for the real `greyhound-trace` CLI.

BPF tests (@pytest.mark.bpf) need root, BCC and uprobes. Outside CI they are
skipped with a loud banner when those are missing; in CI (CI=true) they fail
instead, because a CI run that cannot trace must not look green.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

def _bpf_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not running as root"
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return f"bcc not importable ({e})"
    if not os.path.exists(f"/lib/modules/{os.uname().release}/build/include"):
        return "no kernel headers link (run scripts/setup)"
    return None


BPF_PROBLEM = _bpf_unavailable()
_skipped_bpf: list[str] = []
_loud: dict[str, str] = {}          # banner -> why: privileged tests this machine cannot run


def loud_skip(banner: str, why: str):
    """Skip a privileged test that this machine cannot run, for a reason
    outside the project (said in red in the run's summary, never silently)."""
    _loud[banner] = why
    pytest.skip(f"{banner}: {why}")


def pytest_collection_modifyitems(config, items):
    if BPF_PROBLEM is None:
        return
    for item in items:
        if "bpf" in item.keywords:
            _skipped_bpf.append(item.nodeid)


@pytest.fixture(autouse=True)
def _bpf_gate(request):
    if "bpf" in request.keywords and BPF_PROBLEM is not None:
        if os.environ.get("CI"):
            pytest.fail(f"BPF test cannot run in CI: {BPF_PROBLEM}", pytrace=False)
        pytest.skip(f"BPF test needs root/BCC: {BPF_PROBLEM}")


def pytest_terminal_summary(terminalreporter):
    for banner, why in _loud.items():
        terminalreporter.write_sep("!", banner, red=True, bold=True)
        terminalreporter.write_line(why, red=True)
    if _skipped_bpf:
        tr = terminalreporter
        tr.write_sep("!", f"{len(_skipped_bpf)} BPF TESTS DID NOT RUN: {BPF_PROBLEM}", red=True, bold=True)
        tr.write_line("run `sudo scripts/test` to run them", red=True)


# -- helpers (the harness is shared with the benchmarks and the demo) ---------

from harness import (GREYHOUND, ROOT, Timeout, episode_onset, free_port, kill_tree,  # noqa: E402,F401
                     read_jsonl, wait_for)
from harness import DDPJob as _DDPJob  # noqa: E402
from harness import Tracer as _Tracer  # noqa: E402

TARGETS = ROOT / "tests" / "targets"
QUIET_S = 3.0      # seconds without validation activity before a test injects
SETTLED_SLOW_S = 40.0   # a job slowdown validated as nothing slow, this old, is the level
EPISODE_GAP_S = 10.0    # job recoveries shorter than this join one host episode
read_events = read_jsonl


def run_cli(*args, user=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    """Run greyhound-trace; `user` runs it unprivileged (setpriv)."""
    cmd = [*GREYHOUND, *args]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


class Tracer(_Tracer):
    def healthy_baseline(self, n: int, timeout: float = 120) -> None:
        """Wait for the detectors' baseline: `n` measured iterations of rank 0,
        and no job-level slowdown in progress (a 2-core VM has transients of
        its own: validation workers starting, another test's processes
        exiting). Inject only after this."""
        wait_for(lambda: len(self.measured(0)) >= n, timeout, f"{n} healthy iterations",
                 interval=0.5)

        # Validation activity (workers starting, a validation of a noise
        # slowdown) slows the job down a moment later, and its slowdown is
        # reported only once detected: wait until none has run for QUIET_S,
        # then until no job slowdown is in progress, or one that has lasted
        # SETTLED_SLOW_S and that a validation found nothing slow in: the
        # job's level now (a 1 s stretch at x0.8 right after the attach was
        # the reference once, and the job's usual speed never came back to
        # it). A fault must be named during such an episode too (issue #12).
        from greyhound_bpf.diagnosis.host import busy_since
        quiet = [time.monotonic()]

        def settled():
            if busy_since() is not None:
                quiet[0] = time.monotonic()
                return False
            if time.monotonic() - quiet[0] < QUIET_S:
                return False
            evs = self.events()
            changes = [e for e in evs if e["kind"] in ("slowdown", "recovery")
                       and e["scope"] == "job"]
            if not changes or changes[-1]["kind"] == "recovery":
                return True
            onset = episode_onset(changes, EPISODE_GAP_S)
            return time.time_ns() - onset > SETTLED_SLOW_S * 1e9 and any(
                e["kind"] == "diagnosis" and e["evidence"] == "validation"
                and e["cause"] == "unknown" and e["time_ns"] > onset for e in evs)
        wait_for(settled, 90, "no validation activity and no job slowdown in progress",
                 interval=0.5, why=self.story)


@pytest.fixture
def tracer(tmp_path):
    made: list[Tracer] = []

    def start(pids, *extra, name="events"):
        t = Tracer(tmp_path, list(pids), *extra, name=name)
        made.append(t)
        return t
    yield start
    for t in made:
        t.close()


def DDPJob(tmp: Path, nproc: int, steps: int, *extra: str, go: bool = True,
           prefix: list[str] | None = None, trainer: str = "demo") -> _DDPJob:
    """The harness's job with the tests' defaults: it waits for go() unless
    go=False."""
    return _DDPJob(tmp, nproc, *extra, trainer=trainer, steps=steps, go=go, prefix=prefix)


@pytest.fixture
def ddp_job(tmp_path):
    made: list = []

    def start(nproc, steps, *extra, **kw):
        j = DDPJob(tmp_path, nproc, steps, *extra, **kw)
        made.append(j)
        return j
    yield start
    for j in made:
        j.close()


def nccl_lib() -> str:
    from nvidia import nccl
    return f"{nccl.__path__[0]}/lib/libnccl.so.2"


@pytest.fixture(scope="session")
def ghbench(tmp_path_factory) -> Path:
    """The C tight-loop target, compiled once per session."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: scripts/setup installs gcc")
    out = tmp_path_factory.mktemp("ghbench") / "ghbench"
    subprocess.run([cc, "-O2", "-pthread", "-o", str(out),
                    str(ROOT / "scripts" / "bench" / "ghbench.c"), "-ldl"], check=True)
    return out


def perf_event_fds() -> int:
    """Open perf-event fds of every process: uprobes attached through the perf
    PMU are exactly such fds."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]":
                        n += 1
                except OSError:
                    pass
        except OSError:
            pass
    return n


def uprobe_events() -> list[str]:
    for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        p = Path(d) / "uprobe_events"
        if p.exists():
            return [line for line in p.read_text().splitlines() if line.strip()]
    return []
