"""Validation for a live job (`attach`): a warm pool of workers, measuring
on request in one background thread (diagnosis.validator does the
measuring; diagnosis.crosslinks a node's side of the links between nodes)."""
from __future__ import annotations

import queue
import sys
import threading

from .cpu import IdleGroup
from .host import PAUSE_MAX_S, Member, SpanReport
from .rules import Result
from .validator import P2P_BYTES, P2P_BYTES_GPU, P2P_SECONDS, Validator


class Service:
    """Validation for `attach`: one background thread that measures on
    request. Workers for the job's ranks are started at the first request
    (importing torch costs CPU seconds: a healthy job never pays them) and
    kept idle afterwards (blocked on a pipe, SCHED_IDLE); they are started
    again when the ranks change or one died. Workers on GPUs are not kept:
    each holds a CUDA context (hundreds of MiB, and none at all under
    EXCLUSIVE_PROCESS or on a nearly full GPU), so they exit after every
    validation, and the job's GPUs hold nothing of ours in between.

    Calls come from the tracer's thread and never block it; what happens
    comes back through `post(kind, payload)`: ("activity", (id, what,
    start_ns, end_ns)) for our spans, ("progress", text), and ("result",
    (request id, Result)) once a request is measured."""

    def __init__(self, post, clock, pause_max_s: float = PAUSE_MAX_S,
                 python: str = sys.executable, idle_group: IdleGroup | None = None):
        self.post, self.pause_max_s, self.python = post, pause_max_s, python
        self.idle_group = idle_group
        self.report = SpanReport(lambda *span: post("activity", span), clock)
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.key: tuple | None = None          # the (rank, pid, device) set the pool is for
        self.pool: Validator | None = None
        self.cross = None                       # crosslinks.CrossLinks while one runs
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="greyhound-validate",
                                       daemon=True)
        self.thread.start()

    def request(self, request_id: int, members: list[Member], edges: list[tuple[int, int]],
                devices: list[int] | None = None, cross: dict | None = None,
                suspects: list[int] | None = None) -> None:
        """Measure these ranks' devices (all, or `devices`) and these edges
        (workers started first, if need be), or this node's side of the
        links between nodes (`cross`: crosslinks.CrossLinks' group, edges
        and rendezvous); the result is posted. `suspects`: the ranks the
        verdict asking for it named slow."""
        self.tasks.put(("measure", (request_id, members, edges, devices, cross, suspects)))

    def close(self) -> None:
        self.closing = True
        for running in (self.pool, self.cross):
            if running is not None:
                running.cancel()
        self.tasks.put(("close", None))
        self.thread.join(timeout=15)

    def _run(self) -> None:
        while True:
            what, arg = self.tasks.get()
            if what == "close" or self.closing:
                if self.pool is not None:
                    self.pool.close()
                return
            request_id = arg[0]
            try:
                res = self._measure(*arg)
            except Exception as e:              # never take the tracer down
                self.post("progress", f"validation failed: {type(e).__name__}: {e}")
                res = Result(untested=[f"everything: {type(e).__name__}: {e}"])
            if not self.closing:
                self.post("result", (request_id, res))

    def _measure(self, request_id: int, members: list[Member], edges: list[tuple[int, int]],
                 devices: list[int] | None = None, cross: dict | None = None,
                 suspects: list[int] | None = None) -> Result:
        if cross is not None:
            from .crosslinks import CrossLinks
            gpu = any(m.device.startswith("cuda") for m in members)
            self.cross = CrossLinks(members, cross["group"], cross["edges"],
                                    cross["rendezvous"], self.pause_max_s, self.report,
                                    self.python, self.idle_group,
                                    lambda msg: self.post("progress", msg),
                                    {"bytes": P2P_BYTES_GPU if gpu else P2P_BYTES,
                                     "seconds": P2P_SECONDS})
            try:
                return self.cross.run()
            finally:
                self.cross = None
        key = tuple(sorted((m.rank, m.pid, m.device, m.env.get("CUDA_VISIBLE_DEVICES", ""))
                           for m in members))
        pool = self.pool
        if pool is None or key != self.key or pool.broken or not pool.alive():
            if pool is not None:
                pool.close()
            self.key = key
            self.pool = pool = Validator(members, pause_max_s=self.pause_max_s,
                                         report=self.report, python=self.python,
                                         idle_group=self.idle_group,
                                         progress=lambda msg: self.post("progress", msg))
            untested = pool.start()
            if not pool.ready:
                self._drop_pool()
                return Result(untested=untested or ["no validation workers"])
            self.post("progress", f"{len(pool.ready)} validation workers ready")
        else:
            untested = []
        res = pool.measure(edges, devices, suspects)
        res.untested = untested + res.untested
        if any(m.device.startswith("cuda") for m in members):
            self._drop_pool()
        return res

    def _drop_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool, self.key = None, None
