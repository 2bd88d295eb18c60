"""Shared fixtures: real targets (ctypes NVIDIA calls, torchrun gloo DDP, a C
tight loop) and a runner for the real `greyhound-trace` CLI.

BPF tests (@pytest.mark.bpf) need root, BCC and uprobes. Outside CI they are
skipped with a loud banner when those are missing; in CI (CI=true) they fail
instead, because a CI run that cannot trace must not look green.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "tests" / "targets"
GREYHOUND = [sys.executable, "-m", "greyhound_bpf.cli"]
QUIET_S = 3.0      # seconds without validation activity before a test injects


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
    if _skipped_bpf:
        tr = terminalreporter
        tr.write_sep("!", f"{len(_skipped_bpf)} BPF TESTS DID NOT RUN: {BPF_PROBLEM}", red=True, bold=True)
        tr.write_line("run `sudo scripts/test` to run them", red=True)


# -- helpers -----------------------------------------------------------------

def run_cli(*args, user=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    """Run greyhound-trace; `user` runs it unprivileged (setpriv)."""
    cmd = [*GREYHOUND, *args]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            out.append(json.loads(line))
    return out


def wait_for(pred, timeout: float, what: str, interval: float = 0.05, why=None):
    """Poll `pred` until it returns something true; on a timeout the error
    says what was awaited and, given `why` (a callable), what was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    seen = f"; seen:\n{why()}" if why else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{seen}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """Kill a process and every descendant. torchrun puts each worker in a
    session of its own, so killing the launcher's process group is not enough."""
    from greyhound_bpf.probe.discovery import all_stats, descendants
    tree = descendants([proc.pid], all_stats())
    for pid in tree:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Tracer:
    """A `greyhound-trace attach` subprocess writing JSON events to a file."""

    def __init__(self, tmp: Path, pids: list[int], *extra: str, name: str = "events"):
        self.json = tmp / f"{name}.jsonl"
        self.out = open(tmp / f"{name}.out", "w+")
        cmd = [*GREYHOUND, "attach", *map(str, pids), "--json", str(self.json), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)
        self._events: list[dict] = []
        self._pos = 0

    def events(self, kind: str | None = None) -> list[dict]:
        # Read only what was appended since the last call: tests poll this,
        # and re-parsing a growing file would load the CPU the job runs on.
        if self.json.exists():
            with open(self.json) as fh:
                fh.seek(self._pos)
                chunk = fh.read()
            done = chunk.rfind("\n") + 1
            self._pos += len(chunk[:done].encode())
            self._events += [json.loads(line) for line in chunk[:done].splitlines() if line]
        return [e for e in self._events if kind is None or e["kind"] == kind]

    def story(self) -> str:
        """What the detectors, diagnosis and policy reported, one line per
        event, for a failure message."""
        keep = ("kind", "scope", "index", "ratio", "cause", "evidence", "ranks", "link",
                "strategy", "reason", "numbers", "details")
        return "\n".join(str({k: e[k] for k in keep if k in e}) for e in self.events()
                         if e["kind"] in ("slowdown", "recovery", "action", "diagnosis"))

    def measured(self, rank: int) -> list[dict]:
        """The rank's iterations that the detectors took: after the settling
        time that follows an attach, and not paused by validation."""
        return [e for e in self.events("iteration") if e["rank"] == rank
                and not e.get("settling") and not e.get("paused")]

    def healthy_baseline(self, n: int, timeout: float = 120) -> None:
        """Wait for the detectors' baseline: `n` measured iterations of rank 0,
        and no job-level slowdown in progress (a 2-core VM has transients of
        its own: validation workers starting, another test's processes
        exiting). Inject only after this."""
        wait_for(lambda: len(self.measured(0)) >= n, timeout, f"{n} healthy iterations",
                 interval=0.5)

        # Validation activity (the worker pool starting, a validation of a
        # noise slowdown) slows the job down a moment later, and its
        # slowdown is reported only once detected: wait until none has run
        # for QUIET_S, then until no job slowdown is in progress.
        from greyhound_bpf.diagnosis.host import busy_since
        quiet = [time.monotonic()]

        def settled():
            if busy_since() is not None:
                quiet[0] = time.monotonic()
                return False
            if time.monotonic() - quiet[0] < QUIET_S:
                return False
            changes = [e for e in self.events() if e["kind"] in ("slowdown", "recovery")
                       and e["scope"] == "job"]
            return not changes or changes[-1]["kind"] == "recovery"
        wait_for(settled, 90, "no validation activity and no job slowdown in progress",
                 interval=0.5, why=self.story)

    def attached_ranks(self) -> list[dict]:
        return [r for e in self.events("attach") for r in e["ranks"]]

    def wait_attached(self, n: int, timeout: float = 60) -> list[dict]:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"tracer exited early ({self.proc.returncode}): {self.output()}")
            ranks = self.attached_ranks()
            return ranks if len(ranks) >= n else None
        return wait_for(ready, timeout, f"{n} attached process(es)")

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(f"tracer did not exit: {self.output()}") from None

    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        self.out.close()


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


class DDPJob:
    """torchrun + scripts/demo_train.py (real gloo DDP on the CPU)."""

    def __init__(self, tmp: Path, nproc: int, steps: int, *extra: str, go: bool = True,
                 prefix: list[str] | None = None):
        self.truth = tmp / f"truth-{nproc}.jsonl"
        self.go_file = tmp / "go"
        self.log = open(tmp / f"torchrun-{nproc}.out", "w+")
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               str(ROOT / "scripts" / "demo_train.py"), "--steps", str(steps),
               "--truth", str(self.truth), *extra]
        if go:
            cmd += ["--go-file", str(self.go_file)]
        if prefix:
            cmd = [*prefix, *cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def go(self) -> None:
        self.go_file.touch()

    def truth_records(self) -> list[dict]:
        return [d for d in read_events(self.truth) if not d.get("final")]

    def final_counts(self) -> dict[int, dict]:
        return {d["rank"]: d for d in read_events(self.truth) if d.get("final")}

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError("DDP job did not finish") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        self.log.close()


@pytest.fixture
def ddp_job(tmp_path):
    made: list[DDPJob] = []

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
