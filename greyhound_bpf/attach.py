"""`greyhound-trace attach`: the live loop, I/O only.

    tracer + discovery --inputs--> JobAnalysis --events--> JSON lines, text, live view, metrics
         validator (on request) --^      |  `validation` requests -> validator
         control file acks --------^      `action` plans -> control file (--mitigate)

preflight -> load BPF -> attach to each target -> loop { drain the ring
buffer; rescan; read acks; report losses; feed every input to the analysis
(and --record); route its events } -> detach everything. Every exit path
goes through the same teardown, so no uprobe is left behind; a SIGKILLed
tracer leaves none either: its probes are perf-event fds the kernel closes.
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, TextIO

import numpy as np

from . import GreyhoundError
from .analysis import (Acks, Activity, AnalysisConfig, Calls, JobAnalysis, PlanWritten,
                       Targets, Tick, Validated)
from .diagnosis.cpu import Background
from .diagnosis.host import PAUSE_MAX_S, OtherValidations, describe_rank
from .diagnosis.planner import PAUSE_BUDGET
from .engine.detector import MIN_PROBABILITY, SLOWDOWN_THRESHOLD
from .events import make_event
from .output.console import Terminal
from .output.jsonl import JsonLinesWriter
from .output.summary import CallStats, final_report, safe
from .output.text import describe
from .probe.catalog import Catalog, load_catalog
from .probe.check import has_bpf_privileges
from .probe.discovery import Discovery, Target, job_roots, read_stat, widened_note
from .probe.tracer import DEFAULT_RINGBUF_PAGES, Tracer

# How often the process tree is rescanned for new or exited ranks. Ranks that
# start later are probed within this delay plus the attach time; each scan
# reads /proc/*/stat, CPU taken from the job on a busy node.
SCAN_INTERVAL_S = 1.0
LOST_CHECK_S = 0.5         # the in-kernel loss counter and the trainer's acks are read
TICK_S = 1.0               # the analysis is told the time (waits that end, the topology)
POLL_MS = 200              # the longest wait for records (the kernel wakes us every N)
FLUSH_S = 0.5              # the JSON stream is flushed to its file
VIEW_S = 0.25              # the live view is redrawn


@dataclass
class AttachOptions:
    pids: list[int]
    json_path: str | None = None
    record_path: str | None = None
    calls: bool = False
    duration: float | None = None
    interval: float | None = 1.0
    count: int | None = None
    wait: bool = False
    only_named: bool = False        # a rank's PID is not widened to its job (job_roots)
    ringbuf_pages: int = DEFAULT_RINGBUF_PAGES
    count_launches: bool = False
    job: str | None = None
    threshold: float = SLOWDOWN_THRESHOLD
    min_probability: float = MIN_PROBABILITY
    control_file: str | None = None
    mitigate: bool = False
    microbatches: int | None = None
    restart_estimate_s: float = 60.0
    tui: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_tls: dict | None = None  # prometheus-client's certfile, keyfile, client_cafile
    validate: bool = True           # benchmark devices and links after a job slowdown
    pause_max_s: float = PAUSE_MAX_S
    pause_budget: float = PAUSE_BUDGET
    always_validate: bool = False   # even a verdict its plan confirmed (AnalysisConfig)
    timestamps: bool = False        # -T: wall-clock time on every text line
    cluster: object | None = None   # cluster.cli.AgentSetup: publish to the job's controller


class AttachSession:
    def __init__(self, opts: AttachOptions, catalog: Catalog | None = None,
                 text_out: TextIO | None = None, err: TextIO | None = None):
        self.opts = opts
        self.catalog = catalog or load_catalog()
        to_stdout = opts.json_path == "-"
        self.term = Terminal(text_out or (sys.stderr if to_stdout else sys.stdout),
                             err or sys.stderr, opts.timestamps)
        self.sinks: list[Callable[[dict], None]] = []
        self.roots, self.widened = ((list(opts.pids), []) if opts.only_named
                                    else job_roots(list(opts.pids)))
        self.discovery = Discovery(self.roots, self.catalog)
        self.tracer: Tracer | None = None
        self.stats = CallStats(self.catalog)
        self._fn_names = [fn.name for fn in self.catalog.functions]
        self.known: dict[int, Target] = {}
        self.job = opts.job or self._default_job()
        self.stop_reason: str | None = None
        self.lost_reported = 0
        # The analysis clock: the kernel's CLOCK_MONOTONIC (record times) shifted to the
        # wall clock once, so that a step of the wall clock mid-run moves no duration.
        self.mono_to_wall = time.time_ns() - time.monotonic_ns()
        self.control = None
        if opts.mitigate and not opts.control_file:
            raise GreyhoundError("--mitigate needs --control-file PATH: the file the "
                                 "training script reads its plans from")
        if opts.control_file:
            from mitigation.control import ControlWriter, PlanError, writer_lock
            try:
                self.control = ControlWriter(opts.control_file)
            except PlanError as e:
                raise GreyhoundError(f"--control-file: {e}") from None
        # One writer per control file: a second `attach --mitigate` on the
        # same job advises only (two policies would undo each other's plans).
        self.plan_lock, mitigate = None, opts.mitigate
        if mitigate:                    # (--mitigate comes with a --control-file)
            self.plan_lock, holder = writer_lock(opts.control_file)
            if self.plan_lock is None:
                mitigate = False
                self.say(f"another greyhound-trace{f' (pid {holder})' if holder else ''} "
                         f"writes plans to {opts.control_file}: advising only")
        config = AnalysisConfig(
            threshold=opts.threshold, min_probability=opts.min_probability, validate=opts.validate,
            pause_budget=opts.pause_budget, mitigate=mitigate, plan_tests=not opts.always_validate,
            first_seq=(self.control.seq + 1) if self.control else 1,
            microbatches=opts.microbatches, restart_estimate_s=opts.restart_estimate_s)
        self.analysis = JobAnalysis(self.catalog, self.job, config)
        self.writer = JsonLinesWriter(opts.json_path) if opts.json_path else None
        self.recorder = None
        if opts.record_path:
            from .recording import Recorder, header
            self.recorder = Recorder(opts.record_path, header(
                self.job, config, self.catalog, pids=self.roots), self.catalog)
        self._record_said = self._writer_said = False
        self._followups: list = []                 # inputs caused by handling events
        self._feeding, self.metrics = False, None
        self.agent = None                          # cluster.agent.Agent with --cluster
        self.exited_pids: set[int] = set()
        self.validator = None                      # diagnosis.service.Service, at first use
        self.background: Background | None = None   # diagnosis.cpu.Background, in run()
        self.validated: queue.SimpleQueue = queue.SimpleQueue()
        self._acks_last = None
        self.others = OtherValidations()

    def _default_job(self) -> str:
        pid = self.roots[0] if self.roots else 0
        return f"{st.comm if (st := read_stat(pid)) else 'job'}-{pid}"

    def now_ns(self) -> int:
        """The analysis clock."""
        return time.monotonic_ns() + self.mono_to_wall

    # -- output --------------------------------------------------------------

    def emit(self, kind: str, time_ns: int | None = None, **fields) -> dict:
        """An event of the attach loop itself (attach, exit, lost, detach, call)."""
        self._publish(ev := make_event(kind, self.job, time_ns, **fields))
        return ev

    def _publish(self, ev: dict) -> None:
        if self.writer:
            self.writer.write(ev)
            self._writer_check()
        for sink in self.sinks:
            sink(ev)

    def _writer_check(self) -> None:
        if self.writer.error and not self._writer_said:
            self._writer_said = True
            self.say(f"-o {self.opts.json_path}: {self.writer.error}; events are not written "
                     "from now on (tracing and the view go on; the count is in the summary)")

    def say(self, msg: str) -> None:
        self.term.say(msg)

    # -- the analysis --------------------------------------------------------

    def feed(self, inp) -> None:
        """One input to the analysis (and the recording), then its events
        to the outputs and to whoever acts on them. Inputs that handling
        causes (a plan that could not be written) are fed after, in order,
        so that a replay of the recording sees what the analysis saw."""
        self._followups.append(inp)
        if self._feeding:
            return
        self._feeding = True
        try:
            while self._followups:
                item = self._followups.pop(0)
                if self.recorder is not None:
                    self.recorder.write(item)
                    if self.recorder.error and not self._record_said:
                        self._record_said = True
                        self.say(f"--record {self.opts.record_path}: {self.recorder.error}; "
                                 "recording stopped (tracing goes on)")
                for ev in self.analysis.feed(item):
                    self._route(ev)
                if self.agent:                      # (the job's controller has no calls)
                    self.agent.collectives(self.analysis.shared_collectives())
        finally:
            self._feeding = False

    def _route(self, ev: dict) -> None:
        self._publish(ev)
        kind = ev["kind"]
        if kind not in ("iteration", "activity"):
            line = describe(ev)
            if line:
                self.term.tell(line)
        if kind == "validation" and ev.get("phase") == "request":
            self._start_validation(ev)
        elif kind == "action" and ev.get("seq") is not None and ev.get("phase") != "outcome":
            self._write_plan(ev)

    # -- preflight -----------------------------------------------------------

    def preflight(self) -> None:
        for pid in self.opts.pids:
            if read_stat(pid) is None:
                raise GreyhoundError(f"no process with PID {pid}")
        if not has_bpf_privileges():
            raise GreyhoundError(
                "attach needs root (it loads BPF programs and reads other processes' "
                "memory maps): run it with sudo", exit_code=1)
        for pid, up in self.widened:
            self.say(widened_note(pid, up))
        self._initial_scan = self.discovery.scan()
        if not self.discovery.libraries_seen and not self.opts.wait:
            n = len(self.discovery.tree) - len(self.roots)
            names = ", ".join(self.catalog.sonames)
            pids = ", ".join(map(str, self.roots))
            raise GreyhoundError(
                f"PID {pids} and its {n} descendant(s) map none of {names}; "
                "not a training job yet? (--wait waits for one to be loaded)")

    # -- main loop -----------------------------------------------------------

    def run(self) -> int:
        # Starting costs seconds of CPU (the first scan, the BPF compile, the kernels'
        # cache, symbols): in the background from before the imports, till the probes are in.
        background = self.background = Background.start()
        try:
            self.preflight()
            self.agent = self.opts.cluster and self.opts.cluster.start(self)
        except BaseException:
            background.close()
            raise
        self.tracer = Tracer(self.catalog, self.opts.ringbuf_pages, self.opts.count_launches)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        t0 = time.monotonic()
        try:
            if self.opts.metrics_port is not None:
                from .output.metrics import Metrics
                self.metrics = Metrics(self.opts.metrics_port, self.opts.metrics_addr,
                                       self.opts.metrics_tls)
                self.sinks.append(self.metrics)
                self.say(f"metrics on {self.metrics.url}")
            from .engine import warm_up
            warm_up()          # from the Numba cache; compiles only on a cold one
            if self.opts.tui:
                self.sinks.append(self.term.start_view(self._snapshot))
            self.tracer.load()
            new, _, _ = self._initial_scan
            self._attach_targets(new, first=True)
            if self.control is not None:   # the solver's first use: not at the first plan
                from mitigation.rebalance import warm
                self.feed(Activity(self.now_ns(), "solver", "attach", *warm(self.now_ns)))
            background.restore()
            if background.timed_out:
                self.say(f"start-up outlasted {background.max_s:.0f} s at idle priority "
                         "(the machine is saturated): finished at normal priority")
            if not new:
                self.say(f"waiting for ranks under PID {', '.join(map(str, self.roots))} "
                         "to load a probed library")
            self._loop(t0)
        except GreyhoundError as e:
            self.stop_reason = "error"
            self.emit("detach", reason="error", error=str(e))
            raise
        finally:
            background.restore()
            self.term.stop_view()             # the summary prints below the last view
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if self.stop_reason != "error":
                self._finish(t0)
            else:
                self._stop_validation()
            if self.tracer and self.tracer.bpf and (n := self.tracer.to_remove()) >= 30:
                self.say(f"removing {n} uprobes (the kernel takes one out at a time: ~{n // 10} s)")
            for part in (self.tracer, self.agent, self.writer, self.recorder, self.metrics):
                if part:
                    part.close()
            background.close()      # the workers are gone: the idle group goes
        return 0

    def _on_signal(self, signum, frame) -> None:
        self.stop_reason = self.stop_reason or "signal"

    def _loop(self, t0: float) -> None:
        next_scan = t0 + SCAN_INTERVAL_S
        next_lost = t0 + LOST_CHECK_S
        next_tick = t0 + TICK_S
        next_flush = t0 + FLUSH_S
        next_view = t0
        next_summary = t0 + self.opts.interval if self.opts.interval else None
        summaries = 0
        deadline = t0 + self.opts.duration if self.opts.duration else None
        while self.stop_reason is None:
            self._process(self.tracer.poll(POLL_MS))
            now = time.monotonic()
            if now >= next_lost:
                self._report_losses()
                self._read_acks()
                next_lost = now + LOST_CHECK_S
            if now >= next_scan:
                self._rescan()
                self._note_other_greyhounds()
                next_scan = now + SCAN_INTERVAL_S
            self._collect_validation()
            for ev in self.agent.take_requests() if self.agent else ():
                self._start_validation(ev)         # the job's controller asks
            if now >= next_tick:
                self.feed(Tick(self.now_ns()))
                next_tick = now + TICK_S
            if self.term.live is not None and now >= next_view:
                self.term.refresh(now - t0)
                next_view = now + VIEW_S
            if next_summary and now >= next_summary and not self.stop_reason:
                self.term.tell(self.stats.format_interval(self.analysis.rank_view))
                summaries += 1
                next_summary += self.opts.interval
                if self.opts.count and summaries >= self.opts.count:
                    self.stop_reason = "duration"
            if deadline and now >= deadline:
                self.stop_reason = self.stop_reason or "duration"
            if now >= next_flush:
                if self.writer:
                    self.writer.flush()
                    self._writer_check()
                if self.recorder:
                    self.recorder.flush()
                next_flush = now + FLUSH_S

    def _attach_targets(self, targets: list[Target], first: bool = False) -> None:
        begin = self.now_ns()
        attached = []
        for t in targets:
            probes = self.tracer.attach(t)
            if not probes and not os.path.exists(f"/proc/{t.pid}"):
                continue   # exited while we attached
            self.known[t.pid] = t
            self.stats.add_target(t.pid, t.rank, t.comm)
            attached.append((t, probes))
        if attached:
            self.feed(Targets(self.now_ns(), tuple(
                {"pid": t.pid, "rank": t.rank, "local_rank": t.local_rank,
                 "world_size": t.world_size, "comm": t.comm} for t, _ in attached),
                begin_ns=begin))
        if attached or first:
            fns = sorted({p.fn.name for _, ps in attached for p in ps})
            self.emit("attach", pid=self.roots[0], pids=self.roots, named=list(self.opts.pids),
                      ranks=[describe_rank(t, self.gpus) for t, _ in attached],
                      probes=sum(len(ps) for _, ps in attached), functions=fns,
                      subprocesses=self._subprocesses())
            for t, ps in attached:
                who = t.label("process")
                self.say(f"attached {len(ps)} probes to {who} (pid {t.pid}, "
                         f"{safe(t.comm, 16)}): {', '.join(sorted(t.libraries))}")

    def _subprocesses(self) -> list[dict]:
        """The ranks' subprocesses found by the last scan (not ranks, not probed)."""
        out = []
        for pid, owner in self.discovery.new_subprocesses:
            st = read_stat(pid)
            t = self.known.get(owner) or self.discovery.targets.get(owner)
            out.append({"pid": pid, "of_pid": owner, "rank": t.rank if t else None,
                        "comm": st.comm if st else "?"})
        if out:
            self.say(f"{len(out)} subprocess(es) of ranks (DataLoader or compile workers: not "
                     "ranks, not probed): " + ", ".join(f"pid {d['pid']} of rank {d['rank']}"
                                                         for d in out))
        return out

    def _rescan(self) -> None:
        new, exited, grown = self.discovery.scan()
        if self.discovery.new_subprocesses and not new:
            self._subprocesses()
        for t in exited:
            self.exited_pids.add(t.pid)
            self.tracer.detach(t.pid)
            self.emit("exit", pid=t.pid, rank=t.rank)
            self.say(f"pid {t.pid} (rank {'-' if t.rank is None else t.rank}) exited")
        if exited:
            self.feed(Targets(self.now_ns(), exited=tuple(t.pid for t in exited)))
        for t in grown:
            missing = [f for f in t.libraries if f not in
                       {p.fn.family for p in self.tracer.probes.get(t.pid, [])}]
            self.tracer.attach(t, families=missing)
        if new:
            self._attach_targets(new)
        if not self.discovery.targets and not self.discovery.roots_alive():
            self.stop_reason = self.stop_reason or "target_exited"

    def _report_losses(self) -> None:
        for (pid, fn), why in sorted(self.tracer.site_problems.items()):
            self.emit("unprobed_site", pid=pid, fn=fn, reason=why)
            self.say(f"pid {pid}: a caller of {fn} cannot be probed where it resumes ({why}); "
                     "its calls from there are not timed")
        self.tracer.site_problems.clear()
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
        if self.metrics:
            self.metrics.count_calls(groups, {p: t.rank for p, t in self.known.items()},
                                     self._fn_names)
        # Record times on the analysis clock, in (process, start) order: the
        # ring buffer interleaves CPUs (a copy: the batch is the tracer's).
        recs = recs[np.lexsort((recs["tid"], recs["start_ns"], recs["pid"]))]
        recs["start_ns"] += np.uint64(self.mono_to_wall)
        self.feed(Calls(self.now_ns(), recs))
        if not (self.opts.calls and (self.writer or self.sinks)):
            return
        fns = self.catalog.functions
        for r in recs:
            fn = fns[r["fn"]]
            pid = int(r["pid"])
            t = self.known.get(pid)
            self.emit("call", rank=t.rank if t else None, pid=pid, tid=int(r["tid"]),
                      fn=fn.name, start_ns=int(r["start_ns"]), dur_ns=int(r["dur_ns"]),
                      **self.catalog.decode(fn, r["args"], int(r["ret"]), int(r["flags"])))

    # -- validation ----------------------------------------------------------

    @cached_property
    def gpus(self) -> list:
        from .diagnosis.gpus import nvml_gpus
        return nvml_gpus()

    def _members(self, ranks: list[int]):
        from .diagnosis.host import member_of
        return [member_of(t.pid, t.rank, t.local_rank, self.gpus)
                for pid, t in sorted(self.known.items())
                if t.rank in ranks and pid not in self.exited_pids
                and os.path.exists(f"/proc/{pid}")]

    def _note_other_greyhounds(self) -> None:
        span = self.others.poll(self.now_ns())
        if span is not None:
            self.feed(Activity(self.now_ns(), *span))

    def _start_validation(self, ev: dict) -> None:
        """Benchmark the ranks' devices and links in the background
        (diagnosis.service.Service); the tracer keeps draining."""
        members = self._members(ev["ranks"])
        if self.validator is None:
            from .diagnosis.service import Service
            self.validator = Service(lambda kind, doc: self.validated.put((kind, doc)),
                                     self.now_ns, self.opts.pause_max_s,
                                     idle_group=self.background and self.background.group)
        self.validator.request(ev["id"], members, [tuple(e) for e in ev["edges"]],
                               ev.get("devices"), ev.get("cross"), ev.get("suspects"))
        n = len(ev.get("devices") or members)
        what = ev.get("what") or f"{n} device(s) and {len(ev['edges'])} link(s)"
        self.say(f"validating {what} ({ev['reason']})")

    def _collect_validation(self) -> None:
        while True:
            try:
                what, doc = self.validated.get_nowait()
            except queue.Empty:
                return
            if what == "progress":
                self.say(f"validation: {doc}")
            elif what == "activity":                    # (span id, kind, start, end)
                self.feed(Activity(self.now_ns(), *doc))
            elif what == "result":
                request_id, res = doc            # (links between nodes: the controller's)
                if not res.between_nodes:
                    self.feed(Validated(self.now_ns(), request_id, res.to_dict()))
                if self.agent:
                    self.agent.validated(request_id, res.to_dict())

    def _stop_validation(self) -> None:
        if self.validator is not None:
            self.validator.close()
            self._collect_validation()

    # -- mitigation ----------------------------------------------------------

    def _write_plan(self, ev: dict) -> None:
        from mitigation.control import PlanError
        plan = dict(ev.get("plan") or {})
        if "microbatches" in plan:
            plan["microbatches"] = {int(k): v for k, v in plan["microbatches"].items()}
        try:
            self.control.issue(ev["strategy"], seq=ev["seq"], reason=ev["reason"], **plan)
        except (OSError, PlanError) as e:
            self.say(f"could not write plan {ev['seq']} to {self.opts.control_file}: {e}")
            self.feed(PlanWritten(self.now_ns(), ev["seq"], str(e)))

    def _read_acks(self) -> None:
        if self.control is None:
            return
        docs, cost = self.control.ack_docs(), self.control.restart_observed_s()
        if (docs, cost) != self._acks_last:
            self._acks_last = (docs, cost)
            self.feed(Acks(self.now_ns(), docs, cost))

    # -- live view -----------------------------------------------------------

    def _snapshot(self, state, elapsed: float, width: int):
        return state.snapshot(
            job=self.job, elapsed_s=elapsed, stats=self.stats, view=self.analysis.rank_view,
            straggler=self.analysis.straggler, exited=self.exited_pids,
            probes=sum(len(ps) for ps in self.tracer.probes.values()) if self.tracer else 0,
            lost=self.lost_reported, mode=self.analysis.mode, width=width)

    # -- the end ---------------------------------------------------------------

    def _finish(self, t0: float) -> None:
        self._stop_validation()
        if self.tracer and self.tracer.bpf is not None:
            self._process(self.tracer.drain())
            self._report_losses()
        reason = self.stop_reason or "signal"
        delivered = self.tracer.delivered if self.tracer else 0
        extra = {}
        if self.opts.count_launches and self.tracer and self.tracer.bpf is not None:
            extra["launches"] = {str(pid): n for pid, n in sorted(self.tracer.launch_counts().items())}
        a = self.analysis
        untimed = self.tracer.untimed_total() if self.tracer and self.tracer.bpf else 0
        self.emit("detach", reason=reason, delivered=delivered, lost=self.lost_reported,
                  untimed=untimed, validations=a.planner.validations,
                  paused_s=round(a.paused_total_s, 3), **extra)
        if self.writer:
            self.writer.flush()
        lost_output = [(f"-o {self.opts.json_path}", w.dropped, "event(s) not written", w.error)
                       for w in [self.writer] if w is not None]
        lost_output += [(f"--record {self.opts.record_path}", r.dropped,
                         "input(s) not recorded", r.error) for r in [self.recorder] if r]
        print(final_report(self.stats, self.lost_reported, delivered, time.monotonic() - t0,
                           a.planner.validations, a.paused_total_s, lost_output,
                           extra.get("launches", {}), untimed),
              file=self.term.text_out, flush=True)

