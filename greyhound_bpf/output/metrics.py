"""Prometheus metrics (`attach --metrics [ADDR:]PORT`), served with
prometheus-client on loopback by default, over TLS (prometheus-client's own
options; mutual TLS with a client CA) when a certificate is given, which an
address other than loopback needs unless --metrics-plaintext. Fed by the same events as every
other consumer, plus per-call counts from the tracer's batches.

    greyhound_build_info{version}               1
    greyhound_rank_info{rank,local_rank,pid,node,gpu_uuid,training_job}  1 per rank
                                                (join with DCGM's Hostname on
                                                node, its UUID on gpu_uuid;
                                                empty without a GPU)
    greyhound_iteration_seconds{rank}           last iteration time of a rank
    greyhound_iteration_duration_seconds{rank}  histogram of iteration times
                                                (rate() of its _count:
                                                iterations per second)
    greyhound_calls_total{rank,fn}              probed calls (rank empty, i.e.
                                                absent, for no known rank)
    greyhound_lost_records_total                records the ring buffer dropped
    greyhound_slowdown_active                   1 while the job is slowed down
                                                (a slowdown not yet followed by
                                                a recovery)
    greyhound_straggler{rank}                   1 while a verdict names that
                                                rank's computation, until the
                                                job recovers or a later verdict
                                                names another
    greyhound_diagnoses_total{cause,evidence}   verdicts
    greyhound_validation_pause_seconds_total    time the job was paused
    greyhound_plan_seq                          seq of the last plan written
    greyhound_plan_microbatches{dp_rank}        the split of the plan written
                                                last (mitigate mode)
    greyhound_actions_total{strategy,mode}      decisions of the policy

State gauges say what is true now. In DDP every rank slows with the
slowest (they wait for it in collectives), so a rank's own slowdown is not
a straggler: only a diagnosis names one. No label is called `job`
(Prometheus renames it on scrape).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import ssl

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .. import GreyhoundError, __version__
from ..events import is_speed_sample


def tls_options(cert: str | None, key: str | None, client_ca: str | None, addr: str,
                port: int | None, plaintext: bool) -> dict | None:
    """prometheus-client's TLS options from --metrics-cert/-key/-client-ca;
    refuses plain HTTP on an address other than loopback unless asked."""
    if key and not cert or cert and not key:
        raise GreyhoundError("--metrics-cert and --metrics-key go together", exit_code=2)
    if client_ca and not cert:
        raise GreyhoundError("--metrics-client-ca needs TLS: --metrics-cert and --metrics-key",
                             exit_code=2)
    for f in (cert, key, client_ca):
        if f and not os.path.isfile(f):
            raise GreyhoundError(f"no such file: {f}", exit_code=2)
    if port is None or cert:
        return {"certfile": cert, "keyfile": key,
                "client_cafile": client_ca} if cert else None
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = addr == "localhost"
    if not loopback and not plaintext:
        raise GreyhoundError(
            f"--metrics {addr}:{port} is reachable from the network: serve it over TLS "
            "(--metrics-cert FILE --metrics-key FILE), or say --metrics-plaintext", exit_code=2)
    return None


class Metrics:
    def __init__(self, port: int, addr: str = "127.0.0.1", tls: dict | None = None):
        self.registry = r = CollectorRegistry()
        self.iteration = Gauge("greyhound_iteration_seconds", "Last iteration time of a rank",
                               ["rank"], registry=r)
        self.durations = Histogram(
            "greyhound_iteration_duration_seconds", "Iteration times of a rank", ["rank"],
            buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        Gauge("greyhound_build_info", "Greyhound's version", ["version"],
              registry=r).labels(version=__version__).set(1)
        self.rank_info = Gauge("greyhound_rank_info", "A rank attached",
                               ["rank", "local_rank", "pid", "node", "gpu_uuid", "training_job"],
                               registry=r)
        self.node = socket.gethostname()
        self.diagnoses = Counter("greyhound_diagnoses", "Verdicts", ["cause", "evidence"],
                                 registry=r)
        self.paused = Counter("greyhound_validation_pause_seconds",
                              "Time validation kept the job paused", registry=r)
        self.plan_split = Gauge("greyhound_plan_microbatches",
                                "Micro-batches per data-parallel rank in the plan written last",
                                ["dp_rank"], registry=r)
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
        tls = {k: v for k, v in (tls or {}).items() if v}
        if tls.get("client_cafile"):
            tls["client_auth_required"] = True
        try:
            self.server, self.thread = start_http_server(port, addr=addr, registry=r, **tls)
        except ssl.SSLError as e:
            raise GreyhoundError(f"--metrics-cert/--metrics-key: cannot serve TLS with them ({e})",
                                 exit_code=1) from None
        except OSError as e:
            raise GreyhoundError(f"--metrics {addr}:{port}: cannot listen there ({e})",
                                 exit_code=1) from None
        self.port = self.server.server_port
        host = f"[{addr}]" if ":" in addr else addr
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}/metrics"

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
            self.calls.labels(rank=_label(rank), fn=names[fn]).inc(n)

    def __call__(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "iteration":
            if not is_speed_sample(ev):
                return
            rank = str(ev["rank"])
            self.iteration.labels(rank=rank).set(ev["dur_ns"] / 1e9)
            self.durations.labels(rank=rank).observe(ev["dur_ns"] / 1e9)
            self.straggler.labels(rank=rank)                 # every rank appears, at 0
        elif kind in ("slowdown", "recovery") and ev.get("scope") == "job":
            self.slow.set(1 if kind == "slowdown" else 0)
            if kind == "recovery":
                self._name_stragglers(set())
        elif kind == "diagnosis":
            self.diagnoses.labels(cause=ev["cause"], evidence=ev["evidence"]).inc()
            if ev["cause"] == "computation":
                self._name_stragglers({str(r) for r in ev.get("ranks", [])})
        elif kind == "attach":
            for t in ev.get("ranks", []):
                self.rank_info.labels(rank=_label(t.get("rank")),
                                      local_rank=_label(t.get("local_rank")),
                                      pid=str(t["pid"]), node=self.node,
                                      gpu_uuid=t.get("gpu") or "",
                                      training_job=ev.get("job") or "").set(1)
        elif kind == "activity" and ev.get("what") == "pause" and ev.get("end_ns"):
            self.paused.inc(max(0, ev["end_ns"] - ev["start_ns"]) / 1e9)
        elif kind == "lost":
            self.lost.inc(ev["count"])
        elif kind == "action" and ev.get("phase") != "outcome":
            self.actions.labels(strategy=ev["strategy"], mode=ev["mode"]).inc()
            if ev.get("seq") is not None:
                self.plan_seq.set(ev["seq"])
                for r, n in (ev.get("plan") or {}).get("microbatches", {}).items():
                    self.plan_split.labels(dp_rank=str(r)).set(n)


def _label(v) -> str:
    """A label's value; empty (no label, to Prometheus) when unknown."""
    return "" if v is None else str(v)
