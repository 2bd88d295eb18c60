"""Where validation runs and how it touches the job: each rank's place
(network namespace, cgroups, CPU affinity, device), the job's pause with a
watchdog, one measurement at a time per machine, and another greyhound's
validation seen as a span (announce.py announces it). I/O, no decisions.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..probe.discovery import read_environ, read_stat
from .announce import busy_since, state_dir
from .cpu import cgroups_of
from .gpus import Gpu, Placement, open_minors, place

# Longest the job may be paused by one validation (`--pause-max`): a
# watchdog process resumes it then, even if the tracer is killed.
PAUSE_MAX_S = 5.0
# Variables of the rank that a worker must share to use the same network
# path and device.
PASS_ENV = ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
            "CUDA_VISIBLE_DEVICES", "TP_SOCKET_IFNAME")


@dataclass
class Member:
    """Where one rank runs: what its worker copies."""
    rank: int
    pid: int | None = None              # None in pre-check mode
    device: str = "cpu"
    netns: str | None = None            # /proc/PID/ns/net when not ours
    cgroups: list[Path] = field(default_factory=list)   # cgroup.procs files
    affinity: set[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # GPU ranks: how their GPU was found, or "unknown: why" (its GEMM is
    # then not measured; its links are measured from the worker's cuda:0).
    placement: str = ""


def member_of(pid: int, rank: int, local_rank: int | None, gpus: int) -> Member:
    env = read_environ(pid)
    try:
        theirs = os.readlink(f"/proc/{pid}/ns/net")
        netns = f"/proc/{pid}/ns/net" if theirs != os.readlink("/proc/self/ns/net") else None
    except OSError:
        netns = None
    try:
        affinity = os.sched_getaffinity(pid)
    except OSError:
        affinity = None
    passed = {k: env[k] for k in PASS_ENV if k in env and k != "CUDA_VISIBLE_DEVICES"}
    device, placement = "cpu", ""
    if gpus:
        # The worker runs on the host: it sees the rank's GPU by UUID, as its
        # only device, whatever the rank's own (maybe a container's) view.
        p = rank_gpu(pid, local_rank, gpus, env)
        device, placement = "cuda:0", p.how if p.uuid else f"unknown: {p.how}"
        if p.uuid:
            passed["CUDA_VISIBLE_DEVICES"] = p.uuid
    return Member(rank, pid, device, netns, cgroups_of(pid), affinity, passed, placement)


def netns_id(netns: str | None) -> str:
    """Which network namespace a Member's `netns` is (`/proc/PID/ns/net`
    names the same one for many PIDs; None: ours)."""
    try:
        return os.readlink(netns) if netns else "ours"
    except OSError:
        return str(netns)


def describe_rank(t, gpus: list[Gpu]) -> dict:
    """A target's description for the `attach` event, with, where there are
    GPUs, the one it uses (`gpu`, a UUID or null) and how that was found."""
    d = t.describe()
    if gpus:
        p = rank_gpu(t.pid, t.local_rank, gpus)
        d.update(gpu=p.uuid, gpu_how=p.how)
    return d


def rank_gpu(pid: int, local_rank: int | None, gpus: list[Gpu],
             env: dict[str, str] | None = None) -> Placement:
    """The GPU `pid` uses (diagnosis/gpus.py), from its environment, the
    devices it has open and its local rank."""
    try:
        same_ns = os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    except OSError:
        same_ns = True
    return place(read_environ(pid) if env is None else env, local_rank, gpus,
                 open_minors(pid), same_ns)


class SpanReport:
    """Tells whoever analyses the job when an activity of ours that can
    touch it (engine.activity.WHAT) begins and ends, on the analysis's
    clock: `post(id, what, start_ns, end_ns)`, end_ns None at the start."""

    def __init__(self, post, clock=time.time_ns):
        self.post, self.clock = post, clock
        self._n = 0

    def begin(self, what: str) -> tuple:
        """Returns the token that end() takes."""
        self._n += 1
        token = (f"{what}-{self._n}", what, self.clock())
        self.post(*token, None)
        return token

    def end(self, token: tuple) -> None:
        self.post(*token, self.clock())


# -- the job's pause ------------------------------------------------------------

class Pause:
    """SIGSTOP the ranks; SIGCONT them on exit, and from a watchdog process
    after `max_s` whatever happens to us (it runs in its own session)."""

    def __init__(self, pids: list[int], max_s: float, report: SpanReport | None = None):
        self.pids, self.max_s = [p for p in pids if p], max_s
        # The pause's span, reported as it starts and ends: the analysis
        # keeps the iterations it overlaps from every detector.
        self.report = report
        self.token = None
        self.watchdog: subprocess.Popen | None = None
        self.t0 = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "Pause":
        if not self.pids:
            return self
        cont = " ".join(map(str, self.pids))
        self.watchdog = subprocess.Popen(
            ["sh", "-c", f"sleep {self.max_s:.3f}; kill -CONT {cont} 2>/dev/null"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.t0 = time.monotonic()
        if self.report is not None:
            self.token = self.report.begin("pause")
        for p in self.pids:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if not self.pids:
            return
        for p in self.pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.seconds = min(time.monotonic() - self.t0, self.max_s)
        if self.token is not None:
            self.report.end(self.token)
        if self.watchdog and self.watchdog.poll() is None:
            os.killpg(self.watchdog.pid, signal.SIGKILL)
            self.watchdog.wait()


class MeasureLock:
    """One validation measures at a time on a machine: two would pause the
    job on top of each other and measure each other's load. A file lock,
    released by the kernel if we die. Per node by default; `machine`: one
    for every agent on this machine (nodes simulated on one host, as the
    tests do, measure their devices one at a time, as nodes of their own
    would without each other's load; links between nodes need both ends
    at once, so they take the node's)."""

    def __init__(self, timeout_s: float = 30.0, machine: bool = False):
        self.timeout_s = timeout_s
        self.fh = None
        self.path = state_dir(machine) / "validate.lock"

    def __enter__(self) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = open(self.path, "a")
        except OSError:
            return True                     # no lock file possible: measure anyway
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.fh:
            self.fh.close()                 # releases the lock


class OtherValidations:
    """Another greyhound validating on this machine loads it too: its span,
    as (id, "other", start_ns, end_ns or None) when it begins and ends, is
    an input of the analysis, as ours are."""

    def __init__(self):
        self.open: str | None = None
        self.since = 0
        self.n = 0

    def poll(self, now_ns: int) -> tuple | None:
        since = busy_since(exclude_pid=os.getpid())
        if since is not None and self.open is None:
            self.n += 1
            self.open, self.since = f"other-{self.n}", since
            return (self.open, "other", since, None)
        if since is None and self.open is not None:
            span, self.open = (self.open, "other", self.since, now_ns), None
            return span
        return None
