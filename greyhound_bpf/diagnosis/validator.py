"""Validation benchmarks: measure each device and each link where each rank runs.

Passive evidence says *that* a rank waits or a collective got slower; it
cannot always say whether a device or which link is to blame (NCCL calls are
asynchronous; a ring all-reduce spreads one slow link's cost over every
rank). Validation measures them directly:

- **computation**: a GEMM per device, one worker per rank running where the
  rank runs: in its network namespace, its cgroups and its CPU affinity, so
  a rank throttled by a CPU quota (or a GPU with locked clocks) measures
  slow. On GPUs the GEMMs of different devices run at once, with NVML's
  clocks, temperature and throttle reasons as evidence; on CPUs one at a
  time where ranks share cores (concurrent GEMMs would measure the
  sharing, not the rank), and at once where each rank has CPUs of its own
  (disjoint affinities: the job's own layout, so nothing is shared that the
  job does not share).
- **communication**: a point-to-point ping-pong (latency with 8 bytes,
  bandwidth with `P2P_BYTES`) along every ring edge of the communicator
  (rank order) and every pipeline edge, over torch.distributed (NCCL on GPUs,
  gloo otherwise), in rounds of disjoint pairs that run concurrently: 2
  rounds for an even ring, 3 for an odd one.

The job is paused (SIGSTOP) only while the benchmarks measure, never while
workers start; a watchdog process resumes it after `pause_max_s` even if
this process is killed. A suspect is measured twice in that pause (with the
fastest device as a witness) and, if still slow, once more in a second
short pause after the job has run CONFIRM_AFTER_S; it keeps its best time.
Every wait has a deadline; workers are killed on every exit path and
whatever could not be measured is reported as such.

The decision rules are pure (diagnosis.rules); the host plumbing (pause,
lock, cgroups) is diagnosis.host; links between nodes, diagnosis.crosslinks.
"""
from __future__ import annotations

import sys
import threading
import time

from .. import GreyhoundError
from ..probe.discovery import read_stat
from .gpus import nvml_gpus, wait_drained
from .cpu import IdleGroup
from .announce import Busy
from .host import PAUSE_MAX_S, MeasureLock, Member, Pause, SpanReport, member_of, netns_id
from .workers import Worker, WorkerError, check_python, kill_now  # noqa: F401  (check_python: the CLI's)
from .rules import (Result, keep_better, link_name, link_suspects, outliers, ring_edges,
                    schedule)

P2P_BYTES = 4 << 20
P2P_BYTES_GPU = 64 << 20     # NVLink/InfiniBand: launch overhead would dominate 4 MiB
GEMM_SECONDS = 0.4           # per device and pass (CPU GEMMs one after another: less)
P2P_SECONDS = 0.2            # per edge
# Suspects left after the first pause are measured once more after the job
# has run this long: a busy moment of a shared host can last seconds (in CI
# a healthy rank's GEMM read x1.7 twice, 2 s apart); a slow device or link is
# slow each time.
CONFIRM_AFTER_S = 3.0
# ...unless it measured this slow twice in the first pause: a busy moment
# of a healthy host read at most x1.7; a CPU quota at half reads x5-6.
CONFIRM_SKIP_RATIO = 3.0
# ...or this slow twice where the passive verdict that asked for the
# validation named it: two kinds of evidence, seconds apart, agree (a rank
# at half the CPU it used reads x2.4-2.5; the second pause cost a 40 s fault
# 0.8 s of the job's time and 3 s of waiting, bench_mitigation).
CONFIRM_SKIP_NAMED_RATIO = 2.0
START_TIMEOUT_S = 60.0       # import (torch on GPUs) and join, while the job runs on
# Workers start in the idle CPU group, on CPU the job leaves unused; on a
# saturated machine that may be none, so after this long the group is made
# an ordinary one until they have started: together they then weigh as one
# session (each in a session of its own, four took 80% of a job's CPU).
IDLE_START_MAX_S = 10.0
STEP_TIMEOUT_S = 15.0        # one benchmark command


class Validator:
    def __init__(self, members: list[Member], edges: list[tuple[int, int]] | None = None,
                 pause: bool = True, pause_max_s: float = PAUSE_MAX_S,
                 start_timeout_s: float = START_TIMEOUT_S, progress=None,
                 report: SpanReport | None = None, python: str = sys.executable,
                 confirm_skip_ratio: float = CONFIRM_SKIP_RATIO,
                 idle_group: IdleGroup | None = None):
        if len(members) < 1:
            raise GreyhoundError("nothing to validate: no ranks")
        self.members = sorted(members, key=lambda m: m.rank)
        ranks = [m.rank for m in self.members]
        if len(set(ranks)) != len(ranks):
            raise GreyhoundError(f"ranks are not unique: {ranks}")
        # torch.distributed numbers workers 0..n-1; ranks may be a subset.
        self.index = {m.rank: i for i, m in enumerate(self.members)}
        self.edges = edges if edges is not None else ring_edges(sorted(ranks))
        self.pause, self.pause_max_s = pause, pause_max_s
        self.start_timeout_s = start_timeout_s
        self.progress = progress or (lambda msg: None)
        # Our activity that touches the job (workers starting, pauses),
        # reported with its span to whoever analyses the job.
        self.report = report
        self.python = python
        self.confirm_skip_ratio = confirm_skip_ratio
        # Where workers start and wait (cpu.IdleGroup), or None.
        self.idle_group = idle_group
        self.workers: dict[int, Worker] = {}
        self.ready: list[int] = []
        self.cancelled = False
        self.broken = False

    def cancel(self) -> None:
        """From another thread: kill the workers; run() then returns at once
        (every read fails) and resumes the job on its way out."""
        self.cancelled = True
        kill_now(self.workers.values())

    def run(self) -> Result:
        """Start, measure once, stop: `greyhound-trace validate`."""
        t0 = time.monotonic()
        try:
            untested = self.start()
            res = self.measure() if self.ready else Result()
        finally:
            self.close()
        res.untested = untested + res.untested
        res.seconds = time.monotonic() - t0
        return res

    def start(self) -> list[str]:
        """Start the workers and join them into one group (while the job
        runs on). Returns what could not be started."""
        res = Result()
        # Starting workers loads the host (their imports): not while another
        # validation measures, or it would measure our start-up.
        with MeasureLock(timeout_s=120.0, machine=True) as free, Busy("start"):
            if not free:
                res.untested.append("everything: another validation kept the machine "
                                    "busy for 120 s")
                self.ready = []
            else:
                token = self.report.begin("workers") if self.report else None
                try:
                    self.ready = self._start(res)
                finally:
                    if token:
                        self.report.end(token)
        return res.untested

    def alive(self) -> bool:
        return bool(self.ready) and not self.broken and all(
            w.proc.poll() is None for w in self.workers.values())

    def measure(self, edges: list[tuple[int, int]] | None = None,
                devices: list[int] | None = None,
                suspects: list[int] | None = None) -> Result:
        """Pause the job, GEMM per device, p2p per edge, resume. Workers
        stay up for the next call unless a step failed (then `broken`).
        `suspects`: ranks the passive verdict named slow."""
        res = Result(measured_at_ns=self.report.clock() if self.report else time.time_ns())
        t0 = time.monotonic()
        if edges is not None:
            self.edges = edges
        ready = [r for r in self.ready if self.workers[r].proc.poll() is None]
        for r in sorted(set(self.ready) - set(ready)):
            res.untested.append(f"rank {r}: worker exited")
        n_untested = len(res.untested)
        lock = MeasureLock(machine=True)
        if ready and not lock.__enter__():
            res.untested.append("everything: another validation kept measuring for "
                                f"{lock.timeout_s:.0f} s")
            ready = []
        busy = Busy("measure").__enter__()
        try:
            if ready:
                pids = [m.pid for m in self.members if m.pid] if self.pause else []
                pause = Pause(pids, self.pause_max_s, self.report)
                unplaced = [m for m in self.members if m.placement.startswith("unknown")]
                for m in unplaced:
                    res.untested.append(f"rank {m.rank}: its GPU is {m.placement} (its links "
                                        "are measured from the worker's first GPU)")
                skip = {m.rank for m in unplaced}
                with pause:
                    self._drain(pause, res)
                    self._gemms([r for r in ready if (devices is None or r in devices)
                                 and r not in skip], res)
                    if not self.edges:
                        pass                     # devices only (a recheck)
                    elif len(ready) == len(self.members):
                        self._p2p(res)
                    else:
                        res.untested.append("links: not every worker started")
                res.paused_s, res.pauses = pause.seconds, 1
                self._confirm(ready, pids, res, set(suspects or ()))
        finally:
            lock.__exit__()
            for w in self.workers.values():
                w.idle()
            busy.__exit__()
        if len(res.untested) > n_untested:
            self.broken = True
        res.seconds = time.monotonic() - t0
        return res

    def close(self) -> None:
        for w in self.workers.values():
            w.kill()
        self.workers.clear()
        self.ready = []

    def _start(self, res: Result) -> list[int]:
        n = len(self.members)
        self.progress(f"starting {n} validation worker(s)")
        for m in self.members:
            if self.cancelled:
                break
            if m.pid is not None and read_stat(m.pid) is None:
                res.untested.append(f"rank {m.rank}: exited")
                continue
            try:
                self.workers[m.rank] = Worker(
                    Member(self.index[m.rank], m.pid, m.device, m.netns, m.cgroups,
                           m.affinity, m.env, m.placement), n, STEP_TIMEOUT_S, self.python,
                    self.idle_group)
            except OSError as e:
                res.untested.append(f"rank {m.rank}: worker did not start ({e})")
        deadline = time.monotonic() + self.start_timeout_s
        group = self.idle_group
        promote = None
        if group is not None:
            promote = threading.Timer(IDLE_START_MAX_S, group.set_idle, (False,))
            promote.daemon = True
            promote.start()
        try:
            return self._join(res, deadline)
        finally:
            if promote is not None:
                promote.cancel()
                try:
                    group.set_idle(True)
                except OSError:
                    pass                        # removed meanwhile (closing)

    def _join(self, res: Result, deadline: float) -> list[int]:
        first = self.members[0].rank
        if first not in self.workers:
            res.untested.append("links: no worker for the first rank, which hosts the store")
            return []
        try:
            port = self.workers[first].read(deadline, ("port",))["port"]
        except WorkerError as e:
            res.untested.append(f"rank {first}: {e}")
            self.workers.pop(first).kill()
            return []
        # One network namespace (a node's ranks): the store is on its
        # loopback (a multi-node job's MASTER_ADDR is another node). Ranks in
        # namespaces of their own: the job's MASTER_ADDR, the first rank's.
        one_ns = len({netns_id(m.netns) for m in self.members}) == 1
        addr = "127.0.0.1" if one_ns else self.members[0].env.get("MASTER_ADDR", "127.0.0.1")
        ready = []
        for r, w in self.workers.items():
            try:
                w.send({"cmd": "join", "addr": addr, "port": port})
            except WorkerError as e:
                res.untested.append(f"rank {r}: {e}")
        for r, w in list(self.workers.items()):
            try:
                w.read(deadline)
                ready.append(r)
            except WorkerError as e:
                res.untested.append(f"rank {r}: {e}")
        return ready

    def _drain(self, pause: Pause, res: Result) -> None:
        """GPU work the ranks queued before SIGSTOP still runs: wait for it
        (diagnosis/gpus.py), or say that the GEMMs ran beside it."""
        uuids = sorted({m.env["CUDA_VISIBLE_DEVICES"] for m in self.members
                        if m.device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" in m.env})
        if not pause.pids or not uuids:
            return
        drained, waited = wait_drained(uuids)
        if not drained:
            res.untested.append(f"a clean GPU: the job's queued work still ran {waited:.1f} s "
                                "into the pause, and the GEMMs were timed beside it")

    def _place(self, ready: list[int]) -> tuple[bool, float]:
        """Each worker where its rank runs now; then (at once?, seconds per
        GEMM window). At once on GPUs, and on CPUs where each rank has CPUs
        of its own. On CPUs a window spans several CFS periods (100 ms), or
        a quota would show only in part; one after another, shorter when
        many."""
        for r in ready:
            self.workers[r].place()
        gpus = all(self.workers[r].m.device.startswith("cuda") for r in ready)
        if gpus or disjoint([self.workers[r].m.affinity for r in ready]):
            return True, GEMM_SECONDS
        return False, max(0.25, min(GEMM_SECONDS, 2.4 / max(1, len(ready))))

    def _gemms(self, ready: list[int], res: Result) -> None:
        together, secs = self._place(ready)
        self.progress(f"GEMM on {len(ready)} device(s)"
                      + (" at once" if together else ", one at a time"))
        self._gemm_pass(ready, together, secs, res)
        self._recheck_devices(together, secs, res)

    def _recheck_devices(self, together: bool, secs: float, res: Result) -> None:
        """A suspect is measured again with the fastest device as a witness,
        and keeps its better time: noise (a busy moment of a shared host)
        rarely hits the same device twice, a slow device is slow each time.
        A better time lowers the reference and can make another device
        suspect: repeat until each suspect has been re-measured (3 rounds)."""
        done: set = set()
        for _ in range(3):
            suspects = set(self._slow_devices(res)) - done
            if not suspects:
                break
            self.progress(f"GEMM again on rank(s) {', '.join(map(str, sorted(suspects)))}")
            done |= self._gemm_again(suspects, together, secs, res)

    @staticmethod
    def _slow_devices(res: Result) -> list[int]:
        got = {r: d["ms_per_gemm"] for r, d in res.devices.items()}
        return sorted(outliers(got)[2]) if len(got) >= 2 else []

    def _gemm_again(self, suspects, together: bool, secs: float, res: Result) -> set:
        """Measure the suspects and the fastest device (a witness) once more;
        each keeps its better time. Returns the devices measured."""
        got = {r: d["ms_per_gemm"] for r, d in res.devices.items()}
        again = set(suspects) | {min(got, key=got.get)}
        before = {r: res.devices[r] for r in again if r in res.devices}
        self._gemm_pass(sorted(again), together, secs, res)
        for r, first in before.items():  # still `first`: this GEMM failed
            now = res.devices[r]
            res.devices[r] = keep_better(first, None if now is first else now, "ms_per_gemm")
        return again

    def _links_again(self, edges, res: Result, what: str) -> bool:
        """Measure these edges once more; each keeps its better time. False
        when a step failed."""
        again = self._p2p_rounds(schedule(sorted(edges)), res, what)
        if again is None:
            return False
        for e, d in again.items():
            res.links[e] = keep_better(res.links[e], d, "rtt_ms")
        return True

    def _confirm(self, ready: list[int], pids: list[int], res: Result,
                 named: set = frozenset()) -> None:
        """Suspects left after the first pause, measured once more after the
        job has run CONFIRM_AFTER_S (in a second, short pause)."""
        got = {r: d["ms_per_gemm"] for r, d in res.devices.items()}
        slow = outliers(got)[2] if len(got) >= 2 else {}
        # Measured twice in this pause next to the fastest device, and far
        # beyond what a busy moment does, or beyond it where the passive
        # verdict named it: no need to wait and see.
        sure = {r for r, x in slow.items() if res.devices[r].get("passes", 1) >= 2 and (
            x >= self.confirm_skip_ratio or (r in named and x >= CONFIRM_SKIP_NAMED_RATIO))}
        devices = [r for r in self._slow_devices(res) if r not in sure]
        links = sorted(link_suspects({e: d["rtt_ms"] for e, d in res.links.items()}))
        if (not devices and not links) or self.cancelled or self.broken:
            return
        what = ", ".join([f"rank {r}" for r in devices] + [link_name(e) for e in links])
        self.progress(f"confirming {what} after letting the job run {CONFIRM_AFTER_S:.0f} s")
        time.sleep(CONFIRM_AFTER_S)
        if self.cancelled:
            return
        pause = Pause(pids, self.pause_max_s, self.report)
        with pause:
            if devices:
                together, secs = self._place(ready)
                self._recheck_devices(together, secs, res)
            if links:
                for w in self.workers.values():
                    w.unplace()
                self._recheck_links(res, "p2p confirm")
        res.paused_s, res.pauses = max(res.paused_s, pause.seconds), res.pauses + 1

    def _gemm_pass(self, ranks: list[int], together: bool, secs: float, res: Result) -> None:
        for batch in ([ranks] if together else [[r] for r in ranks]):
            for r in batch:
                try:
                    self.workers[r].send({"cmd": "gemm", "seconds": secs})
                except WorkerError as e:
                    res.untested.append(f"rank {r} GEMM: {e}")
            deadline = time.monotonic() + STEP_TIMEOUT_S
            for r in batch:
                try:
                    res.devices[r] = self.workers[r].read(deadline, ("ms_per_gemm", "gflops"))
                except WorkerError as e:
                    res.untested.append(f"rank {r} GEMM: {e}")

    def _p2p(self, res: Result) -> None:
        for w in self.workers.values():
            w.unplace()
        res.rounds = schedule(self.edges)
        got = self._p2p_rounds(res.rounds, res, "p2p round")
        res.links.update(got or {})
        if got is None:
            return
        self._recheck_links(res, "p2p again")

    def _recheck_links(self, res: Result, what: str) -> None:
        """Suspect edges are measured again (as suspect devices are): a busy
        moment of a shared host rarely hits the same edge twice. A better
        time can lower the reference and make other edges suspect: repeat
        until each suspect has been re-measured (3 rounds at most)."""
        done: set = set()
        for _ in range(3):
            suspects = link_suspects({e: d["rtt_ms"] for e, d in res.links.items()}) - done
            if not suspects:
                break
            if not self._links_again(suspects, res, what):
                return
            done |= suspects
        else:
            res.untested.append("links: suspects kept changing over 3 re-measurements")

    def _p2p_rounds(self, rounds, res: Result, what: str) -> dict | None:
        """{edge: reply}; None when a step failed (the group is then broken:
        later rounds would only time out)."""
        out = {}
        for i, rnd in enumerate(rounds):
            self.progress(f"{what} {i + 1}/{len(rounds)}: "
                          + ", ".join(f"{a}<->{b}" for a, b in rnd))
            for a, b in rnd:
                for me, peer in ((a, b), (b, a)):
                    try:
                        gpu = self.workers[me].m.device.startswith("cuda")
                        self.workers[me].send({"cmd": "p2p", "peer": self.index[peer],
                                               "bytes": P2P_BYTES_GPU if gpu else P2P_BYTES,
                                               "seconds": P2P_SECONDS})
                    except WorkerError as e:
                        res.untested.append(f"link {a}<->{b}: {e}")
            deadline = time.monotonic() + STEP_TIMEOUT_S
            for a, b in rnd:
                try:
                    got = self.workers[a].read(deadline, ("rtt_ms", "gbps", "lat_us"))
                    self.workers[b].read(deadline)
                    out[(a, b)] = got
                except WorkerError as e:
                    res.untested.append(f"link {a}<->{b}: {e}")
                    res.links.update(out)
                    return None
        return out


def disjoint(affinities) -> bool:
    """Each set known, and no CPU in two of them."""
    seen: set = set()
    for a in affinities:
        if not a or seen & set(a):
            return False
        seen |= set(a)
    return True


# -- front ends ---------------------------------------------------------------------

def members_for_job(pids: list[int]) -> list[Member]:
    """Every rank under `pids` (ranks or launchers), as `attach` finds them."""
    from ..probe.catalog import load_catalog
    from ..probe.discovery import Discovery
    for pid in pids:
        if read_stat(pid) is None:
            raise GreyhoundError(f"no process with PID {pid}")
    new, _, _ = Discovery(pids, load_catalog()).scan()
    ranked = [t for t in new if t.rank is not None]
    if not ranked:
        raise GreyhoundError(
            f"no ranks under PID {', '.join(map(str, pids))}: no process there has RANK "
            "(or an MPI/Slurm rank variable) and a probed library mapped")
    gpus = nvml_gpus()
    return [member_of(t.pid, t.rank, t.local_rank, gpus) for t in ranked]


def precheck_members(world: int) -> list[Member]:
    """`--world N` before a job starts: N workers on this host, one per GPU
    (each sees its GPU by UUID as cuda:0) when there are GPUs."""
    gpus = [g for g in nvml_gpus() if g.uuid.startswith("GPU-")]
    if gpus and world > len(gpus):
        raise GreyhoundError(f"--world {world} but this machine has {len(gpus)} GPU(s)")
    return [Member(r, device="cuda:0" if gpus else "cpu",
                   env={"MASTER_ADDR": "127.0.0.1",
                        **({"CUDA_VISIBLE_DEVICES": gpus[r].uuid} if gpus else {})},
                   placement=f"GPU {gpus[r].index}" if gpus else "") for r in range(world)]
