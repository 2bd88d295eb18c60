"""Validation's worker processes, one per rank: started where the rank
runs (its network namespace; its cgroups and CPU affinity only while
measuring its device), idle (SCHED_IDLE, blocked on a pipe) in between,
and driven by one JSON line per command (diagnosis/worker.py)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import GreyhoundError
from ..probe.discovery import threads_of
from .cpu import IdleGroup, cgroups_of
from .host import PASS_ENV, Member

class WorkerError(Exception):
    pass


WORKER_SCRIPT = str(Path(__file__).with_name("worker.py"))


def check_python(python: str, gpus: bool = True) -> None:
    """Workers need PyTorch in `python` for GPUs, NumPy (or PyTorch) for
    CPUs (they import nothing of ours: a job's own interpreter works)."""
    code = ("import torch.distributed" if gpus else
            "try:\n import numpy\nexcept ImportError:\n import torch")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        what = "PyTorch" if gpus else "NumPy (or PyTorch)"
        raise GreyhoundError(
            f"validation needs {what} in {python} "
            f"({(r.stderr.strip().splitlines() or ['?'])[-1]}): pip install "
            f"{'torch' if gpus else 'numpy'} there, or point --python at the job's interpreter")


class Worker:
    def __init__(self, m: Member, world: int, timeout_s: float, python: str = sys.executable,
                 idle_group: IdleGroup | None = None):
        self.m = m
        self.idle_group = idle_group
        self.err = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        for k in PASS_ENV:
            env.pop(k, None)
        env.update(m.env, GH_VAL_RANK=str(m.rank), GH_VAL_WORLD=str(world),
                   GH_VAL_DEVICE=m.device, GH_VAL_TIMEOUT_S=str(timeout_s),
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        if m.device == "cpu":
            # p2p's buffers from the heap: a fresh mmap()ed one (glibc's
            # default over 128 KiB) made a worker's first p2p run 2x slower
            # over all its round trips (7.5 against 3.2 ms for 4 MiB, here),
            # and one link's first measurement look slow.
            env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 20)
        # SCHED_IDLE while starting: its imports would otherwise take CPU
        # from the running job (and, on a busy host, slow it down: a slowdown
        # of our own making). place() makes it a normal task to measure,
        # while the job is paused.
        cmd = ["chrt", "--idle", "0", python, WORKER_SCRIPT]
        if m.netns:
            cmd = ["nsenter", f"--net={m.netns}", "--", *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, env=env, start_new_session=True)
        # Its own session is its own autogroup, where SCHED_IDLE ranks it
        # against nothing: the idle group keeps its imports off the
        # job's CPU (cpu.IdleGroup).
        if idle_group is not None:
            idle_group.join(self.proc.pid)
        self.buf = b""
        if m.affinity:
            try:
                os.sched_setaffinity(self.proc.pid, m.affinity)
            except OSError:
                pass

    def place(self) -> None:
        """Into the rank's cgroups and CPU affinity, just before measuring:
        where the rank is *now* is what counts (a quota may have come since
        the worker started). Not earlier: in a throttled rank's group the
        worker's start-up would share the quota with the busy rank and take
        minutes. Writing cgroup.procs moves every thread of the worker."""
        for tid in threads_of(self.proc.pid):
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
        if self.m.pid is not None:
            self.m.cgroups = cgroups_of(self.m.pid) or self.m.cgroups
            try:
                self.m.affinity = os.sched_getaffinity(self.m.pid)
            except OSError:
                pass
        for f in self.m.cgroups:
            try:
                f.write_text(str(self.proc.pid))
            except OSError:
                pass
        if self.m.affinity:
            try:
                os.sched_setaffinity(self.proc.pid, self.m.affinity)
            except OSError:
                pass

    def idle(self) -> None:
        """Between measurements: out of the rank's groups, into the idle
        group where there is one, and SCHED_IDLE."""
        if self.idle_group is None or not self.idle_group.join(self.proc.pid):
            self.unplace()
        for tid in threads_of(self.proc.pid):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass

    def unplace(self) -> None:
        """Back into our own cgroups: links are measured in the rank's network
        namespace but not under its CPU quota, which is a compute fault (on a
        CPU testbed the TCP stack would measure the quota, not the link)."""
        for f in cgroups_of(os.getpid()):
            try:
                f.write_text(str(self.proc.pid))
            except OSError:
                pass

    def send(self, doc: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(doc) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(self.why_dead()) from None

    def why_dead(self) -> str:
        self.err.seek(0)
        tail = [ln for ln in self.err.read().splitlines() if ln.strip()]
        rc = self.proc.poll()
        return (f"worker exited ({rc})" if rc is not None else "worker stopped answering") + (
            f": {tail[-1][:200]}" if tail else "")

    def read(self, deadline: float, expect: tuple[str, ...] = ()) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"no answer in time (rank {self.m.rank})")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise WorkerError(self.why_dead())
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            doc = json.loads(line)
        except ValueError:
            raise WorkerError(f"unreadable answer: {line[:100]!r}") from None
        if "error" in doc:
            raise WorkerError(doc["error"])
        missing = [k for k in expect if k not in doc]
        if missing:
            raise WorkerError(f"answer without {', '.join(missing)}: {line[:100]!r}")
        return doc

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def kill_now(workers) -> None:
    """From another thread (a cancel): kill them at once; their owner's
    reads then fail and it cleans up on its way out."""
    for w in list(workers):
        if w.proc.poll() is None:
            w.proc.kill()
