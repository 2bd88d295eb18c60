"""Helpers shared by the demo (scripts/demo_story.py) and the end-to-end
benchmarks: start the demo DDP job, find its ranks with the tool's own
discovery, read JSON-lines files that are still being written, and take
medians of the trainer's ground truth."""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from greyhound_bpf.probe.discovery import all_stats, descendants, is_launcher, rank_identity  # noqa: E402,E501

BIN = Path(sys.executable).parent
# A compute-bound job: large micro-batches of a small model, so that the
# gradient all-reduce (one bucket) is a small part of an iteration, as in
# real training; 8 micro-batches per rank, 32 in all with 4 ranks.
TRAIN_ARGS = ["--microbatches", "8", "--mb-size", "256", "--hidden", "128", "--layers", "3",
              "--bucket-mb", "25"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(work: Path, nproc: int, log, *extra: str) -> subprocess.Popen:
    """torchrun + scripts/demo_train.py following work/ctl.json, logging
    its ground truth to work/truth.jsonl. Its own session: Ctrl-C in the
    terminal does not reach it; stop_job() does."""
    return subprocess.Popen(
        [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-port",
         str(free_port()), str(ROOT / "scripts" / "demo_train.py"), *TRAIN_ARGS,
         "--control-file", str(work / "ctl.json"), "--truth", str(work / "truth.jsonl"),
         *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def stop_job(job: subprocess.Popen) -> None:
    """The launcher and every rank (torchrun's workers have sessions of
    their own, so the whole tree is found and killed)."""
    pids = descendants([job.pid], all_stats())
    for pid in [job.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's ranks."""
    stats = all_stats()
    out = {}
    for pid in descendants([launcher], stats):
        rank = rank_identity(pid)[0]
        if rank is not None and not is_launcher(pid):
            out[rank] = pid
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float) -> float:
    """Wait `seconds` and return the CPUs the process used meanwhile (1.0 is
    one CPU): an injection gives a rank half of what it was using."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass        # a line being written
    except FileNotFoundError:
        pass
    return out


def median_dur(truth: list[dict], lo_ns: int, hi_ns: int) -> tuple[float, int]:
    """Job iteration time: the median period between consecutive iteration
    starts of rank 0 (start-to-start, the time the job really spends per
    iteration: the trainer's own `dur_ns` covers zero_grad..step only and
    leaves out the control-file poll and the wait at the top of the step),
    for iterations that started in [lo, hi)."""
    starts = sorted(r["start_ns"] for r in truth
                    if r.get("rank") == 0 and not r.get("final") and "start_ns" in r)
    d = [(b - a) / 1e6 for a, b in zip(starts, starts[1:]) if lo_ns <= a < hi_ns]
    return (statistics.median(d) if d else float("nan")), len(d)


def wait_until(pred, timeout: float, what: str | None = None, interval: float = 0.2):
    """pred()'s first true value within `timeout` s; then None, or an error
    naming `what` when one is given."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    if what:
        raise RuntimeError(f"timed out waiting for {what}")
    return None
