"""The one harness for tests, benchmarks, the demo and the scenario recorder:
start real training jobs (torchrun, or one rank per network namespace),
attach the real `greyhound-trace`, read JSON-lines files that are still
being written, wait with a deadline that says what it waited for, and kill
whole process trees. Not installed: tests import it from here, scripts put
tests/ on their path.
"""
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
BIN = Path(sys.executable).parent
GREYHOUND = [sys.executable, "-m", "greyhound_bpf.cli"]
TRAINERS = {"demo": ROOT / "scripts" / "demo_train.py",
            "user": ROOT / "scripts" / "user_train.py",
            # Job shapes the rules were not written around at first (the
            # corpus says which are still held out).
            "fsdp": ROOT / "examples" / "fsdp_gloo.py",
            "accum": ROOT / "examples" / "transformer_accum.py",
            "ckpt": ROOT / "examples" / "checkpoint_eval.py",
            "varlen": ROOT / "examples" / "varlen_lm.py",
            "powersgd": ROOT / "examples" / "powersgd_cnn.py",
            "bucketed": ROOT / "examples" / "bucketed_mlp.py",
            "moe": ROOT / "examples" / "moe_alltoall.py",
            "tpdp": ROOT / "examples" / "tensor_data_parallel.py",
            "localsgd": ROOT / "examples" / "local_sgd.py",
            "zero": ROOT / "examples" / "zero_ddp.py",
            "rampup": ROOT / "examples" / "batch_rampup.py",
            "static": ROOT / "examples" / "static_graph.py",
            "hsdp": ROOT / "examples" / "hsdp_mesh.py",
            "pipe": ROOT / "examples" / "pipeline_1f1b.py",
            "toy": ROOT / "examples" / "toy_ddp.py",
            "gan": ROOT / "examples" / "gan_ddp.py",
            "join": ROOT / "examples" / "join_lstm.py",
            "clip": ROOT / "examples" / "clip_contrastive.py",
            "ema": ROOT / "examples" / "ema_rank0.py",
            "compile": ROOT / "examples" / "compiled_ddp.py",
            "ppo": ROOT / "examples" / "ppo_rollout.py",
            "vit": ROOT / "examples" / "vit_checkpoint.py",
            "multitask": ROOT / "examples" / "multitask_unused.py",
            "manual": ROOT / "examples" / "manual_allreduce.py",
            "sparse": ROOT / "examples" / "sparse_recsys.py",
            "gossip": ROOT / "examples" / "gossip_sgd.py",
            "syncbn": ROOT / "examples" / "syncbn_cnn.py",
            "ps": ROOT / "examples" / "param_server.py",
            "ring": ROOT / "examples" / "ring_attention.py",
            "ulysses": ROOT / "examples" / "ulysses_attention.py",
            "es": ROOT / "examples" / "evolution_strategies.py",
            "topk": ROOT / "examples" / "topk_compression.py",
            "scatter": ROOT / "examples" / "scatter_batches.py",
            "fairseq": ROOT / "examples" / "fairseq_legacy.py",
            "async": ROOT / "examples" / "async_checkpoint.py",
            "diloco": ROOT / "examples" / "diloco.py",
            "gpipe": ROOT / "examples" / "gpipe_pipelining.py",
            "hier": ROOT / "examples" / "hierarchical_allreduce.py",
            "interleaved": ROOT / "examples" / "interleaved_pipelining.py",
            "mixing": ROOT / "examples" / "data_mixing.py",
            "fednova": ROOT / "examples" / "fednova.py",
            "stale": ROOT / "examples" / "stale_allreduce.py",
            "distill": ROOT / "examples" / "distill_teacher.py",
            "adaptive": ROOT / "examples" / "adaptive_averaging.py"}
# A compute-bound demo job: large micro-batches of a small model, so that
# the gradient all-reduce (one bucket) is a small part of an iteration, as
# in real training; 8 micro-batches per rank, 32 in all with 4 ranks.
DEMO_ARGS = ("--microbatches", "8", "--mb-size", "256", "--hidden", "128", "--layers", "3",
             "--bucket-mb", "25")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# -- waiting ------------------------------------------------------------------------

class Timeout(AssertionError):
    """A wait ran out; the message says what was awaited (and what was seen)."""


def wait_for(pred, timeout: float, what: str | None = None, interval: float = 0.05,
             why=None):
    """pred()'s first true value within `timeout` seconds. When it runs out:
    Timeout naming `what` (with `why()`'s account of what was seen), or None
    when `what` is None."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    if what is None:
        return None
    seen = f"; seen:\n{why()}" if why else ""
    raise Timeout(f"timed out after {timeout:.0f} s waiting for {what}{seen}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- JSON lines ---------------------------------------------------------------------

class JsonlTail:
    """A JSON-lines file that another process is still writing: each read()
    parses only what was appended since (a growing file re-parsed on every
    poll would load the CPU the job runs on); a half-written line waits."""

    def __init__(self, path: Path):
        self.path, self.all, self._pos = Path(path), [], 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                chunk = fh.read()
        except FileNotFoundError:
            return self.all
        done = chunk.rfind(b"\n") + 1
        self._pos += done
        for line in chunk[:done].splitlines():
            if line.strip():
                self.all.append(json.loads(line))
        return self.all

    def kind(self, kind: str) -> list[dict]:
        return [e for e in self.read() if e.get("kind") == kind]


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line of a JSON-lines file (none if it does not exist)."""
    return list(JsonlTail(path).read())


# -- processes ----------------------------------------------------------------------

def descendants_of(pid: int) -> list[int]:
    from greyhound_bpf.probe.discovery import all_stats, descendants
    return descendants([pid], all_stats())


def kill_tree(proc: subprocess.Popen | int, sig=signal.SIGKILL) -> None:
    """A process and every descendant. torchrun puts each worker in a
    session of its own, so killing the launcher's process group is not enough."""
    pid = proc if isinstance(proc, int) else proc.pid
    tree = descendants_of(pid)
    for p in tree:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    if not isinstance(proc, int):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks under a launcher (its DataLoader workers,
    which inherit RANK, are left out: the ranks are the topmost)."""
    from greyhound_bpf.probe.discovery import (all_stats, descendants, is_launcher,
                                               rank_identity)
    stats = all_stats()
    out: dict[int, int] = {}
    for pid in descendants([launcher], stats):
        rank = rank_identity(pid)[0]
        if rank is None or is_launcher(pid):
            continue
        parent = stats[pid].ppid
        if rank_identity(parent)[0] == rank:
            continue                      # a child of the rank (DataLoader worker)
        out[rank] = pid
    return out


def cpu_seconds(pid: int, reaped: bool = False) -> float:
    """The process's user + system CPU seconds (with `reaped`, its waited-for
    children's too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process, its live descendants and its reaped ones."""
    total = 0.0
    for p in descendants_of(pid):
        try:
            total += cpu_seconds(p, reaped=True)
        except OSError:
            continue
    return total


def cpu_share(pid: int, seconds: float) -> float:
    """Wait `seconds` and return the CPUs the process used meanwhile (1.0 is
    one CPU): an injection gives a rank a share of what it was using."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


# -- training jobs ------------------------------------------------------------------

def trainer_command(trainer: str, truth: Path, *args: str) -> list[str]:
    return [str(TRAINERS[trainer]), "--truth", str(truth), *args]


class DDPJob:
    """torchrun + a trainer (scripts/demo_train.py or scripts/user_train.py),
    real gloo DDP on the CPU, logging its own per-iteration truth."""

    def __init__(self, work: Path, nproc: int, *args: str, trainer: str = "demo",
                 steps: int = 0, go: bool = False, prefix: list[str] | None = None,
                 name: str | None = None):
        name = name or f"{trainer}-{nproc}"
        self.work = Path(work)
        self.truth = self.work / f"truth-{name}.jsonl"
        self.go_file = self.work / f"go-{name}"
        self.log = open(self.work / f"torchrun-{name}.out", "w+")
        extra = list(args) + ["--steps", str(steps)]
        if go:
            extra += ["--go-file", str(self.go_file)]
        # Under greyhound-run, its {nproc}: a relaunch may have fewer ranks.
        supervised = any(str(p).endswith("greyhound-run") for p in prefix or [])
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", "{nproc}" if supervised else str(nproc),
               "--master-port",
               str(free_port()), *trainer_command(trainer, self.truth, *extra)]
        self.proc = subprocess.Popen([*(prefix or []), *cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.pid = self.proc.pid
        self._truth = JsonlTail(self.truth)

    def go(self) -> None:
        self.go_file.touch()

    def truth_records(self) -> list[dict]:
        return [d for d in self._truth.read() if not d.get("final")]

    def final_counts(self) -> dict[int, dict]:
        return {d["rank"]: d for d in self._truth.read() if d.get("final")}

    def ranks(self, n: int, timeout: float = 120) -> dict[int, int]:
        """rank -> pid, once all n ranks run."""
        return wait_for(lambda: (lambda r: r if len(r) == n else None)(rank_pids(self.pid)),
                        timeout, f"{n} ranks")

    def trained(self, iterations: int, timeout: float = 120) -> None:
        wait_for(lambda: len(self.truth_records()) >= iterations, timeout,
                 "the job to train", interval=0.2)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise Timeout("the DDP job did not finish") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        self.log.close()


def median_dur(truth: list[dict], lo_ns: int, hi_ns: int, rank: int = 0) -> tuple[float, int]:
    """The job's iteration time from its own log: the median period between
    consecutive iteration starts of `rank` (start to start: a trainer's own
    `dur_ns` leaves out the control-file poll and the wait at the top of the
    step), for iterations that started in [lo, hi)."""
    starts = sorted(r["start_ns"] for r in truth
                    if r.get("rank") == rank and not r.get("final") and "start_ns" in r)
    d = [(b - a) / 1e6 for a, b in zip(starts, starts[1:]) if lo_ns <= a < hi_ns]
    return (statistics.median(d) if d else float("nan")), len(d)


# -- the tracer -----------------------------------------------------------------------

class Tracer:
    """A `greyhound-trace attach` subprocess writing JSON events to a file."""

    def __init__(self, work: Path, pids: list[int], *extra: str, name: str = "events"):
        self.json = Path(work) / f"{name}.jsonl"
        self.out = open(Path(work) / f"{name}.out", "w+")
        cmd = [*GREYHOUND, "attach", *map(str, pids), "-o", str(self.json), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)
        self._tail = JsonlTail(self.json)

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self._tail.read() if kind is None or e["kind"] == kind]

    def since_attach(self, t_ns: int) -> float:
        """Seconds from the first event (attach) to t_ns."""
        first = self._tail.read()[:1]
        return round((t_ns - first[0]["time_ns"]) / 1e9, 2) if first else float("nan")

    def story(self) -> str:
        """What the detectors, diagnosis and policy reported, and greyhound's
        own activity, one line per event with its time since attach (s), for
        a failure message."""
        keep = ("kind", "scope", "index", "ratio", "cause", "evidence", "ranks", "link",
                "strategy", "reason", "phase", "numbers", "details", "what", "id")
        return "\n".join(f"{self.since_attach(e['time_ns'])} " + str({
            **{k: e[k] for k in keep if k in e},
            **{k: self.since_attach(e[k]) for k in ("onset_ns", "start_ns", "end_ns")
               if e.get(k)}}) for e in self.events()
            if e["kind"] in ("slowdown", "recovery", "action", "diagnosis", "validation",
                             "activity"))

    def measured(self, rank: int) -> list[dict]:
        """The rank's iterations that tell the job's speed."""
        from greyhound_bpf.events import is_speed_sample
        return [e for e in self.events("iteration") if e["rank"] == rank
                and is_speed_sample(e)]

    def attached_ranks(self) -> list[dict]:
        return [r for e in self.events("attach") for r in e["ranks"]]

    def wait_attached(self, n: int, timeout: float = 60) -> list[dict]:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"tracer exited early ({self.proc.returncode}): "
                                     f"{self.output()}")
            ranks = self.attached_ranks()
            return ranks if len(ranks) >= n else None

        def why() -> str:                 # what the tracer saw and said, for the failure
            return (f"attach events: {self.events('attach')}\n"
                    f"tracer output (end): {self.output()[-3000:]}")
        return wait_for(ready, timeout, f"{n} attached process(es)", why=why)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise Timeout(f"tracer did not exit: {self.output()}") from None

    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(30)

    def close(self) -> None:
        """Stopped as a user stops it (SIGINT: its probes, workers and idle
        CPU group go with it), and killed only if it will not stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
        self.out.close()


def mitigating_healthy(start_tracer, root: int, n: int, control: Path, healthy_s: float,
                       restart_cost: str = "3") -> tuple[dict[int, int], "Tracer"]:
    """`attach --mitigate` on a supervised job (greyhound-run at `root`)
    once its n ranks run; the healthy phase asserted: `healthy_s` seconds
    with no verdict naming a cause and no plan. Returns (rank -> pid, the
    tracer)."""
    ranks = wait_for(lambda: (lambda r: r if len(r) == n else None)(rank_pids(root)), 120,
                     f"{n} ranks")
    t = start_tracer([root], "-q", "--control-file", str(control), "--mitigate",
                     "--restart-cost", restart_cost)
    t.wait_attached(n)
    time.sleep(healthy_s)
    healthy = t.events()
    assert [e for e in healthy if e["kind"] == "action" and e["strategy"] != "none"] == []
    assert [e for e in healthy if e["kind"] == "diagnosis" and e["cause"] != "unknown"] == [], \
        t.story()
    return ranks, t


def under_fault_from(slow_from_ns: int, until_ns: int, settle_s: float = 5.0) -> float:
    """Where a fault's own iterations start, for a test that compares them
    with a plan's: `settle_s` past the fault (its detection and the quota's
    first periods), or the later half of the time to the plan (`until_ns`)
    when the plan paid for itself sooner than that."""
    return min(slow_from_ns + settle_s * 1e9, (slow_from_ns + until_ns) / 2)


def named(t: "Tracer", since_ns: int = 0) -> list[dict]:
    """The tracer's diagnoses that name a cause, from `since_ns` on."""
    return [e for e in t.events("diagnosis") if e["cause"] != "unknown"
            and e["time_ns"] >= since_ns]


def wrong(verdicts: list[dict], rank: int) -> list[dict]:
    """Verdicts other than "rank `rank` is slow at computation"."""
    return [e for e in verdicts if not (e["cause"] == "computation" and e["ranks"] == [rank])]


def unconfirmed_slowdowns(events: list[dict], truth: list[dict], lo_ns: int = 0,
                          hi_ns: int = 1 << 62) -> list[dict]:
    """Job slowdowns with their onset in [lo, hi) that the job's own log
    (every rank's, start to start: corpus.job_log) does not show over the
    detector's own windows (tests/corpus.py: `confirmed`). A healthy phase
    may hold slowdowns the host caused (its log shows them), never ones the
    tool made up."""
    import corpus
    log = corpus.job_log(truth)
    return [e for e in events if e["kind"] == "slowdown" and e.get("scope") == "job"
            and lo_ns <= e["onset_ns"] < hi_ns and not corpus.confirmed(log, e)]


def episode_onset(changes: list[dict], gap_s: float) -> int:
    """The onset (time_ns) of the job slowdown in progress at the end of
    `changes` (job-scope slowdowns and recoveries, in order, the last a
    slowdown): a host that flaps (a slowdown, a recovery lasting a moment,
    a slowdown again; a CI run saw 90 s of it) is one episode, so a
    recovery shorter than `gap_s` joins the slowdowns either side."""
    onset, i = changes[-1]["time_ns"], len(changes) - 1
    while i > 0 and not (changes[i - 1]["kind"] == "recovery"
                         and changes[i]["time_ns"] - changes[i - 1]["time_ns"] > gap_s * 1e9):
        i -= 1
        if changes[i]["kind"] == "slowdown":
            onset = changes[i]["time_ns"]
    return onset
