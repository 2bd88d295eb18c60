"""`greyhound-trace attach`: the live loop from PIDs to events.

preflight (PIDs, privileges, libraries) -> load BPF -> attach to each target
-> loop { drain ring buffer -> decode -> sinks; rescan the process tree;
report lost records; print the interval summary } -> detach everything.
Every exit path (targets gone, Ctrl-C, SIGTERM, --duration, an error) goes
through the same teardown, so no uprobe is left behind; a SIGKILLed tracer
leaves none either, because its probes are perf-event fds the kernel closes.
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

import numpy as np

from . import GreyhoundError
from .probe.catalog import Catalog, load_catalog
from .probe.discovery import Discovery, Target, read_stat
from .events import make_event
from .output.jsonl import JsonLinesWriter
from .output.text import describe_engine_event
from .engine.pipeline import JobPipeline
from .output.summary import CallStats, safe
from .probe.check import has_bpf_privileges
from .probe.tracer import DEFAULT_RINGBUF_PAGES, Tracer

# How often the process tree is rescanned for new or exited ranks. Ranks that
# start later are probed within this delay plus the attach time; each scan
# reads /proc/*/stat, CPU taken from the job on a busy node.
SCAN_INTERVAL_S = 1.0
# How often the in-kernel loss counter is read (a per-CPU map lookup).
LOST_CHECK_S = 0.5
# Longest wait for records; the kernel also wakes us every N records.
POLL_MS = 200
# How often the JSON stream is flushed to its file.
FLUSH_S = 0.5
# How often the live view is redrawn.
VIEW_S = 0.25
# Job iterations before validation workers are started (their start costs
# CPU; the detectors first learn the job's healthy speed).
POOL_AFTER_ITERATIONS = 30
# Seconds after an attach before the detectors take iterations again:
# attaching uprobes and the tracer's start-up slow the job for a moment.
SETTLE_S = 2.0


@dataclass
class AttachOptions:
    pids: list[int]
    json_path: str | None = None
    calls: bool = False
    duration: float | None = None
    interval: float | None = 1.0
    count: int | None = None
    wait: bool = False
    ringbuf_pages: int = DEFAULT_RINGBUF_PAGES
    count_launches: bool = False
    job: str | None = None
    threshold: float = 0.10
    min_probability: float = 0.9
    control_file: str | None = None
    mitigate: bool = False
    microbatches: int | None = None
    restart_estimate_s: float = 60.0
    tui: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    validate: bool = True           # benchmark devices and links after a job slowdown
    pause_max_s: float = 5.0


class AttachSession:
    def __init__(self, opts: AttachOptions, catalog: Catalog | None = None,
                 text_out: TextIO | None = None, err: TextIO | None = None):
        self.opts = opts
        self.catalog = catalog or load_catalog()
        self.err = err or sys.stderr
        to_stdout = opts.json_path == "-"
        self.text_out = text_out or (sys.stderr if to_stdout else sys.stdout)
        self.writer = JsonLinesWriter(opts.json_path) if opts.json_path else None
        self.sinks: list[Callable[[dict], None]] = []
        self.discovery = Discovery(opts.pids, self.catalog)
        self.tracer: Tracer | None = None
        self.stats = CallStats(self.catalog)
        self._fn_names = [fn.name for fn in self.catalog.functions]
        self.pipeline = JobPipeline(self.catalog, threshold=opts.threshold,
                                    min_probability=opts.min_probability)
        self.known: dict[int, Target] = {}
        self.job = opts.job or self._default_job()
        self.stop_reason: str | None = None
        self.lost_reported = 0
        self.mono_to_wall = time.time_ns() - time.monotonic_ns()
        self.control = None
        if opts.mitigate and not opts.control_file:
            raise GreyhoundError("--mitigate needs --control-file PATH: the file the "
                                 "training script reads its plans from")
        if opts.control_file:
            from mitigation.control import ControlWriter, PlanError
            try:
                self.control = ControlWriter(opts.control_file)
            except PlanError as e:
                raise GreyhoundError(f"--control-file: {e}") from None
        from mitigation.policy import SkiRentalPolicy
        from .diagnosis.passive import PassiveDiagnoser
        from .engine.topology import Topology
        self.topology = Topology(self.catalog)
        self.diagnoser = PassiveDiagnoser(topology=self.topology)
        self.policy = SkiRentalPolicy(global_microbatches=opts.microbatches,
                                      restart_estimate_s=opts.restart_estimate_s)
        self.metrics = None
        self.live = None                           # rich.live.Live while the TUI runs
        self.tui_state = None
        self._rates: dict[int, tuple[float, int]] = {}   # pid -> (time, calls) at last view
        self._calls_total = (0.0, 0)
        self.exited_pids: set[int] = set()
        self.pending_plan: dict | None = None      # issued, waiting for every rank's ack
        self.outcome_due: dict | None = None       # applied, its effect not measured yet
        self.validator = None                      # validate.Service, once the job runs
        self.validated: queue.SimpleQueue = queue.SimpleQueue()

    def _default_job(self) -> str:
        st = read_stat(self.opts.pids[0]) if self.opts.pids else None
        return f"{st.comm if st else 'job'}-{self.opts.pids[0] if self.opts.pids else 0}"

    # -- output --------------------------------------------------------------

    def emit(self, kind: str, time_ns: int | None = None, **fields) -> dict:
        ev = make_event(kind, self.job, time_ns, **fields)
        if self.writer:
            self.writer.write(ev)
        for sink in self.sinks:
            sink(ev)
        return ev

    def say(self, msg: str) -> None:
        if self.live is not None:
            self.tui_state.note(msg)          # the live view's event log
            return
        print(f"greyhound-trace: {msg}", file=self.err, flush=True)

    def tell(self, line: str) -> None:
        """An engine/policy event line for the text output (the live view
        logs the events themselves)."""
        if self.live is None:
            print(line, file=self.text_out, flush=True)

    # -- preflight -----------------------------------------------------------

    def preflight(self) -> None:
        for pid in self.opts.pids:
            if read_stat(pid) is None:
                raise GreyhoundError(f"no process with PID {pid}")
        if not has_bpf_privileges():
            raise GreyhoundError(
                "attach needs root (it loads BPF programs and reads other processes' "
                "memory maps): run it with sudo", exit_code=1)
        self._initial_scan = self.discovery.scan()
        if not self.discovery.libraries_seen and not self.opts.wait:
            n = len(self.discovery.tree) - len(self.opts.pids)
            names = ", ".join(self.catalog.sonames)
            pids = ", ".join(map(str, self.opts.pids))
            raise GreyhoundError(
                f"PID {pids} and its {n} descendant(s) map none of {names}; "
                "not a training job yet? (--wait waits for one to be loaded)")

    # -- main loop -----------------------------------------------------------

    def run(self) -> int:
        self.preflight()
        self.tracer = Tracer(self.catalog, self.opts.ringbuf_pages, self.opts.count_launches)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        t0 = time.monotonic()
        try:
            if self.opts.metrics_port is not None:
                from .output.metrics import Metrics
                self.metrics = Metrics(self.opts.metrics_port, self.opts.metrics_addr)
                self.sinks.append(self.metrics)
                self.say(f"metrics on http://{self.opts.metrics_addr}:{self.metrics.port}/metrics")
            from .engine import warm_up
            warm_up()          # from the Numba cache; compiles only on a cold one
            if self.opts.tui:
                self._start_tui()
            self.tracer.load()
            new, _, _ = self._initial_scan
            self._attach_targets(new, first=True)
            if not new:
                self.say(f"waiting for ranks under PID {', '.join(map(str, self.opts.pids))} "
                         "to load a probed library")
            self._loop(t0)
        except GreyhoundError as e:
            self.stop_reason = "error"
            self.emit("detach", reason="error", error=str(e))
            raise
        finally:
            if self.live is not None:
                self.live.stop()              # the summary prints below the last view
                self.live = None
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if self.stop_reason != "error":
                self._finish(t0)
            if self.tracer:
                self.tracer.close()
            if self.writer:
                self.writer.close()
            if self.metrics:
                self.metrics.close()
        return 0

    def _on_signal(self, signum, frame) -> None:
        self.stop_reason = self.stop_reason or "signal"

    def _loop(self, t0: float) -> None:
        next_scan = t0 + SCAN_INTERVAL_S
        next_lost = t0 + LOST_CHECK_S
        next_flush = t0 + FLUSH_S
        next_view = t0
        next_summary = t0 + self.opts.interval if self.opts.interval else None
        summaries = 0
        deadline = t0 + self.opts.duration if self.opts.duration else None
        while self.stop_reason is None:
            self._process(self.tracer.poll(POLL_MS))
            now = time.monotonic()
            if now >= next_lost:
                self._report_lost()
                self._read_acks()
                next_lost = now + LOST_CHECK_S
            if now >= next_scan:
                self._rescan()
                self._keep_validation_pool()
                self._note_busy()
                next_scan = now + SCAN_INTERVAL_S
                topo = self.topology.changed()
                if topo:
                    ev = self.emit("topology", **topo)
                    self.tell(describe_engine_event("topology", ev))
            self._collect_validation()
            if self.live is not None and now >= next_view:
                from .output.tui import render
                self.live.update(render(self._snapshot(now - t0)), refresh=True)
                next_view = now + VIEW_S
            if (next_summary and now >= next_summary and not self.stop_reason
                    and self.live is None):
                print(self.stats.format_interval(self.pipeline.rank_view), file=self.text_out,
                      flush=True)
                summaries += 1
                next_summary += self.opts.interval
                if self.opts.count and summaries >= self.opts.count:
                    self.stop_reason = "duration"
            if deadline and now >= deadline:
                self.stop_reason = self.stop_reason or "duration"
            if self.writer and now >= next_flush:
                self.writer.flush()
                next_flush = now + FLUSH_S

    def _attach_targets(self, targets: list[Target], first: bool = False) -> None:
        attached = []
        for t in targets:
            probes = self.tracer.attach(t)
            if not probes and not os.path.exists(f"/proc/{t.pid}"):
                continue   # exited while we attached
            self.known[t.pid] = t
            self.stats.add_target(t.pid, t.rank, t.comm)
            self.pipeline.add_rank(t.pid, t.rank)
            attached.append((t, probes))
        if attached:
            # Attaching perturbs the job (and the ranks already traced) for a
            # moment: the detectors start (or go on) after it has passed.
            self.pipeline.settle_until_ns = max(self.pipeline.settle_until_ns,
                                                time.time_ns() + int(SETTLE_S * 1e9))
        if attached or first:
            fns = sorted({p.fn.name for _, ps in attached for p in ps})
            self.emit("attach", pid=self.opts.pids[0], pids=list(self.opts.pids),
                      ranks=[t.describe() for t, _ in attached],
                      probes=sum(len(ps) for _, ps in attached), functions=fns)
            for t, ps in attached:
                who = f"rank {t.rank}" if t.rank is not None else "process"
                self.say(f"attached {len(ps)} probes to {who} (pid {t.pid}, "
                         f"{safe(t.comm, 16)}): {', '.join(sorted(t.libraries))}")

    def _rescan(self) -> None:
        new, exited, grown = self.discovery.scan()
        for t in exited:
            self.exited_pids.add(t.pid)
            self.tracer.detach(t.pid)
            self.emit("exit", pid=t.pid, rank=t.rank)
            self.say(f"pid {t.pid} (rank {'-' if t.rank is None else t.rank}) exited")
        for t in grown:
            missing = [f for f in t.libraries if f not in
                       {p.fn.family for p in self.tracer.probes.get(t.pid, [])}]
            self.tracer.attach(t, families=missing)
        if new:
            self._attach_targets(new)
        if not self.discovery.targets and not self.discovery.roots_alive():
            self.stop_reason = self.stop_reason or "target_exited"

    def _report_lost(self) -> None:
        total = self.tracer.lost_total()
        if total > self.lost_reported:
            delta = total - self.lost_reported
            self.lost_reported = total
            self.emit("lost", count=delta, total=total)
            self.say(f"ring buffer full: {delta} records lost ({total} in all); "
                     "a larger --ringbuf-pages keeps more")

    def _process(self, recs: np.ndarray) -> None:
        if len(recs) == 0:
            return
        groups = self.stats.add(recs)
        ranks = {pid: t.rank for pid, t in self.known.items()}
        self.topology.feed(recs, ranks)
        if self.metrics:
            self.metrics.count_calls(groups, ranks, self._fn_names)
        for kind, fields, t_ns in self.pipeline.feed_records(recs, ranks, self.mono_to_wall):
            ev = self.emit(kind, t_ns, **fields)
            if kind != "iteration":
                self.tell(describe_engine_event(kind, fields))
            self._diagnose(ev, t_ns)
            self._mitigate(ev)
        if not (self.opts.calls and (self.writer or self.sinks)):
            return
        fns = self.catalog.functions
        offset = self.mono_to_wall
        for r in recs:
            fn = fns[r["fn"]]
            pid = int(r["pid"])
            t = self.known.get(pid)
            self.emit("call", rank=t.rank if t else None, pid=pid, tid=int(r["tid"]),
                      fn=fn.name, start_ns=int(r["start_ns"]) + offset, dur_ns=int(r["dur_ns"]),
                      **self.catalog.decode(fn, r["args"], int(r["ret"]), int(r["flags"])))

    # -- validation ----------------------------------------------------------

    def _diagnose(self, ev: dict, t_ns: int | None = None) -> None:
        for fields in self.diagnoser.observe(ev):
            d = self.emit("diagnosis", t_ns, **fields)
            self.tell(describe_engine_event("diagnosis", d))
            # Validation follows the passive verdict: by then the slowdown
            # has lasted `min_after` iterations, so blips cost no pause.
            # A named cause is validated even when the job has recovered
            # meanwhile: a rebalance hides a slow rank, it does not fix it.
            if ((self.diagnoser.slowdown is not None or fields["cause"] != "unknown")
                    and not fields["details"].get("below_min_ratio")):
                self._start_validation(fields["index"])

    def _members(self):
        from .diagnosis import host as validate
        if not hasattr(self, "_gpus"):
            self._gpus = validate.gpu_count()
        return [validate.member_of(t.pid, t.rank, t.local_rank, self._gpus)
                for pid, t in sorted(self.known.items())
                if t.rank is not None and pid not in self.exited_pids
                and os.path.exists(f"/proc/{pid}")]

    def _note_busy(self) -> None:
        """Windows of validation activity on this machine (ours or another
        greyhound's), for the passive diagnosis."""
        from .diagnosis.host import busy_since
        since, w = busy_since(), self.diagnoser.busy
        if since is not None and not (w and w[-1][1] is None):
            w.append([since, None])
        elif since is None and w and w[-1][1] is None:
            w[-1][1] = time.time_ns()
        del w[:-32]

    def _validation_service(self):
        if self.validator is None:
            from .diagnosis.validator import Service
            self.validator = Service(lambda kind, doc: self.validated.put((kind, doc)),
                                     self.opts.pause_max_s, self.pipeline.pauses)
        return self.validator

    def _keep_validation_pool(self) -> None:
        """Once the job has run a while (the detectors have their baseline),
        keep idle validation workers for its current ranks."""
        if not self.opts.validate or len(self.pipeline._job_fed) < POOL_AFTER_ITERATIONS:
            return
        self._validation_service()
        self.validator.keep(self._members())

    def _start_validation(self, index: int) -> None:
        """Benchmark every rank's device and links in the background
        (greyhound_bpf.validate.Service); the tracer keeps draining."""
        if not self.opts.validate:
            return
        self._validation_service()
        members = self._members()
        if len(members) < 2:
            return
        self.validator.keep(members)
        from .diagnosis.rules import edges_of
        edges = edges_of(self.topology.fields(), [m.rank for m in members])
        if self.validator.request(index, edges):
            self.say(f"validating {len(members)} ranks' devices and links (slowdown at "
                     f"iteration {index})")

    def _collect_validation(self) -> None:
        while True:
            try:
                what, doc = self.validated.get_nowait()
            except queue.Empty:
                return
            if what == "progress":
                self.say(f"validation: {doc}")
                continue
            d = self.emit("diagnosis", **doc)
            self.tell(describe_engine_event("diagnosis", d))

    def _stop_validation(self) -> None:
        if self.validator is not None:
            self.validator.close()
            self._collect_validation()

    # -- live view -----------------------------------------------------------

    def _start_tui(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from .output.tui import TuiState, render
        self.tui_state = TuiState()
        self.sinks.append(self.tui_state)
        console = Console(file=self.text_out)
        self.live = Live(render(self._snapshot(0.0, console.width)), console=console,
                         auto_refresh=False, transient=False, redirect_stdout=False,
                         redirect_stderr=False)
        self.live.start()

    def _snapshot(self, elapsed: float, width: int | None = None):
        from .output.tui import RankRow, Snapshot
        now = time.monotonic()
        rows = []
        stragglers = self.tui_state.stragglers
        named = self.policy.straggler
        total = 0
        for rs in self.stats._sorted():
            calls = sum(f.count for f in rs.fns.values())
            total += calls
            t_prev, c_prev = self._rates.get(rs.pid, (now, calls))
            rate = (calls - c_prev) / (now - t_prev) if now > t_prev else 0.0
            if now - t_prev >= 1.0 or rs.pid not in self._rates:
                self._rates[rs.pid] = (now, calls)
            v = self.pipeline.rank_view(rs.pid)
            state = v["state"]
            if rs.pid in self.exited_pids:
                state = "exited"
            elif rs.rank is not None and rs.rank == named:
                state = "straggler"
            elif rs.rank in stragglers and state == "ok":
                state = "slow"
            rows.append(RankRow(rs.rank, rs.pid, rs.comm, v["iter_ms"], v["comm_frac"],
                                max(rate, 0.0), state))
        t_prev, c_prev = self._calls_total
        ev_rate = (total - c_prev) / (now - t_prev) if t_prev and now > t_prev else 0.0
        if not t_prev or now - t_prev >= 1.0:
            self._calls_total = (now, total)
        probes = sum(len(ps) for ps in self.tracer.probes.values()) if self.tracer else 0
        return Snapshot(job=self.job, elapsed_s=elapsed, probes=probes,
                        events_per_s=max(ev_rate, 0.0), lost=self.lost_reported,
                        ranks=tuple(rows), history=tuple(self.tui_state.history),
                        marks=self.tui_state.marks_in_history(),
                        log=tuple(self.tui_state.log),
                        mode="mitigate" if self.opts.mitigate else "advise",
                        width=width or (self.live.console.width if self.live else 80))

    # -- mitigation ----------------------------------------------------------

    def _mitigate(self, ev: dict) -> None:
        for d in self.policy.observe(ev):
            seq = None
            if self.opts.mitigate and d.strategy != "none":
                from mitigation.control import PlanError
                try:
                    plan = self.control.issue(d.strategy, reason=d.reason, **d.plan)
                except (OSError, PlanError) as e:
                    self.say(f"could not write plan to {self.opts.control_file}: {e}")
                    self.policy.withdraw()
                else:
                    seq = plan.seq
                    self.pending_plan = {"seq": seq, "strategy": d.strategy,
                                         "expected_ms": d.expected_ms,
                                         "issued": time.monotonic()}
            elif d.strategy != "none":
                self.policy.withdraw()          # advise only: reported, not written
            f = d.fields()
            out = self.emit("action", seq=seq, mode="mitigate" if self.opts.mitigate
                            else "advise", **f)
            self.tell(describe_engine_event("action", out))
        due = self.outcome_due
        if (due and ev["kind"] == "iteration" and self.policy.since_plan >= self.policy.window
                and self.policy.recent_job_ms() is not None):
            self.outcome_due = None
            out = self.emit("action", phase="outcome", seq=due["seq"], strategy=due["strategy"],
                            expected_ms=due["expected_ms"],
                            achieved_ms=round(self.policy.recent_job_ms(), 3))
            self.tell(describe_engine_event("action", out))

    def _read_acks(self) -> None:
        if self.control is None:
            return
        docs = self.control.ack_docs()
        self.policy.acks(docs)
        self.policy.restart_observed_s = self.control.restart_observed_s()
        p = self.pending_plan
        if p is None or not docs:
            return
        done = sorted(r for r, d in docs.items() if d["seq"] >= p["seq"])
        if len(done) == len(docs):
            self.pending_plan = None
            after_ms = (time.monotonic() - p["issued"]) * 1e3
            ev = self.emit("applied", seq=p["seq"], ranks=done, after_ms=round(after_ms, 1))
            self.tell(describe_engine_event("applied", ev))
            self._diagnose(ev)
            if p["strategy"] == "rebalance_microbatches":
                self.outcome_due = p

    def _finish(self, t0: float) -> None:
        self._stop_validation()
        if self.tracer and self.tracer.bpf is not None:
            self._process(self.tracer.drain())
            self._report_lost()
        reason = self.stop_reason or "signal"
        delivered = self.tracer.delivered if self.tracer else 0
        extra = {}
        if self.opts.count_launches and self.tracer and self.tracer.bpf is not None:
            extra["launches"] = {str(pid): n for pid, n in sorted(self.tracer.launch_counts().items())}
        self.emit("detach", reason=reason, delivered=delivered, lost=self.lost_reported, **extra)
        if self.writer:
            self.writer.flush()
        print(self.stats.format_final(self.lost_reported, delivered, time.monotonic() - t0),
              file=self.text_out, flush=True)
        for pid, n in extra.get("launches", {}).items():
            print(f"pid {pid}: {n} cudaLaunchKernel calls (counted in the kernel)",
                  file=self.text_out, flush=True)
