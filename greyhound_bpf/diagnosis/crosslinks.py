"""One node's part in measuring the links *between* nodes (issue #14).

A link between two hosts can only be timed with a process at each end, so
the controller asks every agent whose ranks are on a cross-node edge, and
each agent starts workers for its own ranks (where they run: netns,
affinity; diagnosis/workers.py). Together they form one process group of
their own, never the job's: the group's first rank's worker hosts a
TCPStore and says where it listens (its address toward the job's
MASTER_ADDR, in its rank's namespace); the controller passes that to the
others through the command stream (`Rendezvous`, supplied by the agent).

Then every node pauses its own ranks and runs its side of the same rounds
(diagnosis.rules.schedule: disjoint pairs, concurrently): a worker's
commands run one after another and a point-to-point call blocks until its
peer's, so the nodes keep step without a clock. The lower rank of an edge
reports its time; the controller merges what every node reports and
decides (diagnosis.rules.decide, with the rank -> node map: every edge
between one node and the others slow is that node's link).
"""
from __future__ import annotations

import sys
import time

from .announce import Busy
from .host import MeasureLock, Member, Pause, SpanReport
from .rules import Result, schedule
from .workers import Worker, WorkerError, kill_now

START_TIMEOUT_S = 60.0       # import (in the idle group) and answer
RENDEZVOUS_S = 60.0          # the store's address, from the controller
STEP_TIMEOUT_S = 20.0        # joining waits for the slowest node's workers


class CrossLinks:
    def __init__(self, members: list[Member], group: list[int], edges, rendezvous,
                 pause_max_s: float, report: SpanReport | None = None,
                 python: str = sys.executable, idle_group=None, progress=None,
                 p2p=None):
        """`members`: this node's ranks in the group; `group`: every rank of
        the group, on any node (worker i is the i-th lowest); `edges`:
        the cross-node edges to measure (every node gets the same list);
        `rendezvous`: offer(addr, port) and wait(timeout) -> (addr, port)."""
        self.members = {m.rank: m for m in members}
        self.group = sorted(group)
        self.index = {r: i for i, r in enumerate(self.group)}
        self.rounds = schedule([tuple(e) for e in edges])
        self.rendezvous, self.pause_max_s, self.report = rendezvous, pause_max_s, report
        self.python, self.idle_group = python, idle_group
        self.progress = progress or (lambda msg: None)
        self.p2p = p2p or {"bytes": 4 << 20, "seconds": 0.2}
        self.workers: dict[int, Worker] = {}
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        kill_now(self.workers.values())

    def run(self) -> Result:
        t0 = time.monotonic()
        res = Result(measured_at_ns=self.report.clock() if self.report else time.time_ns(),
                     rounds=self.rounds, between_nodes=True)
        try:
            if self._start(res):
                self._measure(res)
        except WorkerError as e:
            res.untested.append(f"links between nodes: {e}")
        finally:
            for w in self.workers.values():
                w.kill()
            self.workers.clear()
        res.seconds = time.monotonic() - t0
        return res

    def _start(self, res: Result) -> bool:
        mine = [r for r in self.group if r in self.members]
        with MeasureLock(timeout_s=120.0) as free, Busy("start"):
            if not free:
                res.untested.append("links between nodes: another validation kept this "
                                    "machine busy for 120 s")
                return False
            token = self.report.begin("workers") if self.report else None
            try:
                self.progress(f"starting {len(mine)} worker(s) for the links between nodes")
                for r in mine:
                    m = self.members[r]
                    self.workers[r] = Worker(
                        Member(self.index[r], m.pid, m.device, m.netns, m.cgroups, m.affinity,
                               m.env, m.placement), len(self.group), STEP_TIMEOUT_S,
                        self.python, self.idle_group)
                deadline = time.monotonic() + START_TIMEOUT_S
                first = self.group[0]
                if first in self.workers:
                    got = self.workers[first].read(deadline, ("port",))
                    self.rendezvous.offer(got.get("addr") or "127.0.0.1", int(got["port"]))
                at = self.rendezvous.wait(RENDEZVOUS_S)
                if at is None or self.cancelled:
                    res.untested.append("links between nodes: no store address from the "
                                        f"controller in {RENDEZVOUS_S:.0f} s")
                    return False
                for w in self.workers.values():
                    w.send({"cmd": "join", "addr": at[0], "port": at[1]})
                for w in self.workers.values():
                    w.read(deadline + STEP_TIMEOUT_S, ("ready",))
                    w.place()                    # a normal task (not SCHED_IDLE)...
                    w.unplace()                  # ...out of the rank's CPU quota
            finally:
                if token:
                    self.report.end(token)
        return True

    def _measure(self, res: Result) -> None:
        mine = set(self.workers)
        pids = [self.members[r].pid for r in sorted(mine) if self.members[r].pid]
        lock = MeasureLock()
        if not lock.__enter__():
            res.untested.append("links between nodes: another validation kept measuring")
            return
        try:
            with Busy("measure"), Pause(pids, self.pause_max_s, self.report) as pause:
                for i, rnd in enumerate(self.rounds):
                    here = [(a, b) for a, b in rnd if a in mine or b in mine]
                    if not here or self.cancelled:
                        continue
                    self.progress(f"p2p between nodes {i + 1}/{len(self.rounds)}: "
                                  + ", ".join(f"{a}<->{b}" for a, b in here))
                    for a, b in here:
                        for me, peer in ((a, b), (b, a)):
                            if me in mine:
                                self.workers[me].send({"cmd": "p2p", "peer": self.index[peer],
                                                       **self.p2p})
                    deadline = time.monotonic() + STEP_TIMEOUT_S
                    for a, b in here:
                        if b in mine:
                            self.workers[b].read(deadline)
                        if a in mine:             # the lower rank reports the edge
                            res.links[(a, b)] = self.workers[a].read(
                                deadline, ("rtt_ms", "gbps", "lat_us"))
            res.paused_s, res.pauses = pause.seconds, 1
        finally:
            lock.__exit__()
