"""Prometheus metrics (`attach --metrics-port PORT`), served with
prometheus-client on loopback by default. Fed by the same events as every
other consumer, plus per-call counts from the tracer's batches.

    greyhound_iteration_seconds{rank}      last iteration time of each rank
    greyhound_calls_total{rank,fn}         probed calls (rank empty, i.e. absent,
                                           for a process of no known rank)
    greyhound_lost_records_total           records the ring buffer dropped
    greyhound_slowdown_active              1 while the job is slowed down (its
                                           detector's state: a slowdown not yet
                                           followed by a recovery)
    greyhound_straggler{rank}              1 while a verdict names that rank's
                                           computation, until the job recovers
                                           or a later verdict names another

State gauges say what is true now. In DDP every rank slows with the
slowest (they wait for it in collectives), so a rank's own slowdown is
not a straggler: only a diagnosis names one.
    greyhound_plan_seq                     seq of the last plan written
    greyhound_actions_total{strategy,mode} decisions of the policy
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .. import GreyhoundError
from ..events import is_speed_sample


class Metrics:
    def __init__(self, port: int, addr: str = "127.0.0.1"):
        self.registry = r = CollectorRegistry()
        self.iteration = Gauge("greyhound_iteration_seconds", "Last iteration time of a rank",
                               ["rank"], registry=r)
        self.calls = Counter("greyhound_calls", "Probed calls", ["rank", "fn"], registry=r)
        self.lost = Counter("greyhound_lost_records", "Records dropped by the ring buffer",
                            registry=r)
        self.slow = Gauge("greyhound_slowdown_active", "1 while the job is slowed down",
                          registry=r)
        self.straggler = Gauge("greyhound_straggler",
                               "1 while a verdict names this rank's computation as the cause",
                               ["rank"], registry=r)
        self.named: set[str] = set()
        self.plan_seq = Gauge("greyhound_plan_seq", "seq of the last plan written", registry=r)
        self.actions = Counter("greyhound_actions", "Policy decisions", ["strategy", "mode"],
                               registry=r)
        try:
            self.server, self.thread = start_http_server(port, addr=addr, registry=r)
        except OSError as e:
            raise GreyhoundError(f"--metrics {addr}:{port}: cannot listen there ({e})",
                                 exit_code=1) from None
        self.port = self.server.server_port

    def _name_stragglers(self, ranks: set[str]) -> None:
        for r in self.named - ranks:
            self.straggler.labels(rank=r).set(0)
        for r in ranks:
            self.straggler.labels(rank=r).set(1)
        self.named = ranks

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count_calls(self, groups, rank_of: dict[int, int | None], names: list[str]) -> None:
        """`groups`: (pid, function id, calls) as CallStats.add returns them."""
        for pid, fn, n in groups:
            rank = rank_of.get(pid)
            # An empty label value is no label to Prometheus.
            self.calls.labels(rank="" if rank is None else str(rank), fn=names[fn]).inc(n)

    def __call__(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "iteration":
            if not is_speed_sample(ev):
                return
            self.iteration.labels(rank=str(ev["rank"])).set(ev["dur_ns"] / 1e9)
            self.straggler.labels(rank=str(ev["rank"]))      # every rank appears, at 0
        elif kind in ("slowdown", "recovery") and ev.get("scope") == "job":
            self.slow.set(1 if kind == "slowdown" else 0)
            if kind == "recovery":
                self._name_stragglers(set())
        elif kind == "diagnosis" and ev.get("cause") == "computation":
            self._name_stragglers({str(r) for r in ev.get("ranks", [])})
        elif kind == "lost":
            self.lost.inc(ev["count"])
        elif kind == "action" and ev.get("phase") != "outcome":
            self.actions.labels(strategy=ev["strategy"], mode=ev["mode"]).inc()
            if ev.get("seq") is not None:
                self.plan_seq.set(ev["seq"])
