"""When to act on a slowdown, and how: a ski-rental policy over S1..S4 that
holds a plan while its fault lasts.

The policy reads the event stream every other consumer reads (speed-sample
`iteration`s, job `slowdown` / `recovery`, `diagnosis`) plus what the
trainer announced in its acks, and returns Decisions; it does no I/O, so
the live attach, a replay and tests drive it the same way.

An *episode* begins with a job slowdown, or with a verdict naming one
rank's computation while the job shows no slowdown (a job already slow at
attach, a fault the job-level detector missed). Within it:

1. **Who.** Only a verdict names the straggler: validated over passive,
   and a later verdict naming another rank replaces it. Without one nothing
   is planned: rebalancing cannot help a communication slowdown, and on an
   unknown one it would be a guess.
2. **How fast.** Each rank's compute per micro-batch (compute time over the
   micro-batches it ran), a mean over the last SPEED_SPAN_S of the episode's
   samples taken under the split in force and, before any plan, since the
   job's speed last moved (a CFS quota's bursts: the median reads the fast
   iterations). The straggler must measure slower than the others'
   median by MIN_SLOWER; where host-side compute cannot show it (GPUs: NCCL
   is asynchronous) but validation measured its device slow, its speed is
   the others' times its measured GEMM ratio.
3. **When (ski rental).** The *loss* is the time the episode has cost, the
   sum over job iterations of (iteration - healthy); a rebalance *costs*
   about one iteration plus SOLVE_COST_MS. The first plan comes once the
   episode has lasted `min_lasted_s` (shorter ones are a busy host's blips)
   and its loss has reached that cost, if the best split is predicted at
   least `min_gain` faster.
4. **Where work may go.** Only onto ranks shown healthy: the straggler is
   capped at the count it runs now, any other rank named slow at its own;
   the rest are free.
5. **Hold.** The plan stays while the fault lasts. Speeds measured under a
   plan never decide that the fault is gone: a CFS quota caps throughput,
   so a throttled rank given less work looks healthy per micro-batch. One
   refinement at most, looked for once the plan is measured (and while it
   runs REFINE_OFF slower than predicted): a split 2 x `min_gain` better by
   each rank's line through its two splits (episode.two_split_lines), in
   which the straggler's count only goes down.
6. **Is the fault gone?** Evidence that does not depend on the plan: a
   validation of the straggler's device (`recheck_due`), RECHECK_AFTER_S
   after the plan was applied, then at that or doubling intervals (a ski
   rental: mitigation.gone; the validation budget applies); a validated
   verdict that measures it healthy returns the even split and ends it.
   With validation off, a recheck refused, or where a trial costs less than
   the recheck's pause, a trial return to the even split on that schedule:
   it stays if, over `window` iterations and `trial_min_s` (their mean), the
   job runs within RECOVERED of healthy, or nearer healthy than in the fault
   with no rank still computing much more at that equal work; if not, the
   plan returns (mitigation.gone). Advise only, the job's recovery ends it.
7. **At most MAX_CHANGES plan changes per episode**, besides the return to even.
8. **Restarts (S3/S4)** when the trainer can checkpoint and the loss a
   restart would have avoided pays for the observed (or estimated)
   restart: a pipeline re-split, or leaving out ranks slower than 2x.
"""
from __future__ import annotations

import statistics
from collections import deque

from greyhound_bpf.diagnosis.rules import device_healthy, device_slow
from greyhound_bpf.events import is_speed_sample

from .episode import RECHECK_AFTER_S
from .episode import Episode as _Episode
from .episode import Rank as _Rank
from .episode import two_split_lines
from .gone import RECOVERED, TRIAL_MIN_S, FaultGone
from .rebalance import RebalanceError, even_split, solve
from .restart import Decision, restart_decision

RESTART_ESTIMATE_S = 60.0   # a restart's cost until greyhound-run has measured one
# A slowdown is a blip, and gets no plan, until it has lasted this long (as
# for the passive diagnosis: a busy host slows a rank for a moment).
MIN_LASTED_S = 1.0
# What solving for a new split costs, in the ski-rental sum: the solver's
# time at 1,024 data-parallel ranks (scripts/bench_rebalance: 22.6 ms). A
# constant, not the measured time: the policy is part of a pure analysis,
# whose replay must decide the same.
SOLVE_COST_MS = 25.0
# The straggler's compute per micro-batch must be this much over the others'
# median for host-side timing to show it (the diagnosis's own bar is higher).
MIN_SLOWER = 0.10
REFINE_OFF = 0.15         # a plan this much slower than predicted: look again
MAX_CHANGES = 2
# Speeds and the job's iteration are means over the samples of this long (at
# least 4 windows of iterations): twenty periods of a CFS quota (100 ms),
# whose bursts a shorter span reads in part.
SPEED_SPAN_S = 2.0
SAMPLES_KEPT = 512            # per rank: 2 s of a 4 ms iteration


class SkiRentalPolicy(FaultGone):
    def __init__(self, *, global_microbatches: int | None = None, world: int | None = None,
                 window: int = 8, min_gain: float = 0.05,
                 restart_estimate_s: float = RESTART_ESTIMATE_S, allow_restart: bool = True,
                 min_lasted_s: float = MIN_LASTED_S, validate: bool = True,
                 trial_min_s: float = TRIAL_MIN_S, speed_span_s: float = SPEED_SPAN_S):
        self.window, self.min_gain = window, min_gain
        self.speed_span_ns, self.min_lasted_ns, self.trial_min_ns = (
            int(x * 1e9) for x in (speed_span_s, min_lasted_s, trial_min_s))
        self.pause_ms: float | None = None        # the last validation pause measured
        self.global_microbatches, self.world = global_microbatches, world
        self.restart_estimate_s, self.restart_observed_s = restart_estimate_s, None
        self.allow_restart, self.validate = allow_restart, validate
        self.ranks: dict[int, _Rank] = {}
        self._lowest: int | None = None           # min(self.ranks)
        self.announced: dict[int, dict] = {}      # rank -> its last ack document
        self._layers: tuple = ()                  # the pipeline's layer split announced
        self.split: dict[int, int] | None = None  # dp_rank -> micro-batches now in force
        self.planned: dict[int, int] | None = None  # issued, not yet applied by every rank
        self.advised: dict[int, int] | None = None  # the last split advised (advise only)
        self.episode: _Episode | None = None
        self.since_plan = 0                       # job iterations since the split changed
        self.split_from_ns: int | None = None      # when the first of them started
        self.applied_ns = 0
        self.planned_ns = 0
        self.unapplied_said = False
        self.restart_pending = False              # a restart was planned; the relaunch ends it
        self.job_history: deque = deque(maxlen=window)
        self._now_ns = 0

    # -- read-only state --------------------------------------------------------------

    @property
    def straggler(self) -> int | None:
        """The dp rank the plan in force works around."""
        e = self.episode
        return e.straggler if e is not None and e.changes and not self._is_even() else None

    @property
    def slow(self) -> bool:
        return self.episode is not None

    def _recent(self, r: _Rank) -> int:
        return r.recent(self.speed_span_ns, 4 * self.window)

    def recent_job_ms(self) -> float | None:
        """Job iteration time over the recent samples: the median over ranks
        of each rank's mean (a mean: _Rank.per_microbatch says why)."""
        means = [r.mean_ms(self._recent(r)) for r in self.ranks.values() if r.dur_ms]
        return statistics.median(means) if means else None

    def job_ms(self) -> float | None:
        lasts = [r.dur_ms[-1] for r in self.ranks.values() if r.dur_ms]
        return statistics.median(lasts) if lasts else None

    # -- inputs ---------------------------------------------------------------------

    def acks(self, docs: dict[int, dict]) -> None:
        """The trainer's acks (ControlWriter.ack_docs()): the split in force."""
        self.announced = docs
        counts = {}
        for d in docs.values():
            n, dp = d.get("microbatches"), d.get("dp_rank", d.get("rank"))
            if isinstance(n, int) and isinstance(dp, int):
                counts[dp] = n
        worlds = {d.get("world") for d in docs.values()}
        layers = {tuple(d.get("layer_split") or ()) for d in docs.values()}
        if len(layers) == 1 and layers != {self._layers}:
            self._layers = layers.pop()      # a relaunch re-split the pipeline:
            for r in self.ranks.values():    # the old split's samples are gone
                r.clear()
        if counts and self.world is not None and len(counts) != self.world and \
                worlds == {len(counts)} and all(d.get("seq") == 0 for d in docs.values()):
            # Every rank of a new launch has announced itself, in another
            # world (a restart left ranks out): the old ranks, their speeds,
            # the episode and the split are gone; the policy starts over on
            # the new world, and a later fault is mitigated there.
            self.world, self.split, self.planned, self.advised = None, None, None, None
            self.episode, self.restart_pending = None, False
            self.ranks.clear()
            self.job_history.clear()
        if counts and (self.world is None or len(counts) == self.world):
            self.world = len(counts)
            self.global_microbatches = sum(counts.values())
            changed = counts != self.split
            self.split = counts
            if self.planned is not None and counts == self.planned:
                self.planned = None
                # Iterations that started before the last rank applied the
                # plan still ran the old split (the tracer reports them late).
                self.applied_ns = max((int(d.get("applied_ns", 0)) for d in docs.values()),
                                      default=0)
                changed = True
            if changed:
                self.since_plan = 0
                for r in self.ranks.values():
                    r.clear()

    def withdraw(self) -> None:
        """Advise only: the plan was reported, not written; nothing applies it."""
        if self.planned is not None:
            self.advised = self.planned
        self.planned = None
        self.restart_pending = False           # advised only: no restart will come

    def restart_cost(self) -> tuple[float, str]:
        seen = self.restart_observed_s
        return (seen, "observed") if seen is not None else (self.restart_estimate_s, "estimated")

    def observe(self, ev: dict) -> list[Decision]:
        kind = ev.get("kind")
        if is_speed_sample(ev):
            return self._iteration(ev)
        if kind == "slowdown" and ev.get("scope") == "job":
            if self.episode is None:
                self._begin(int(ev["onset_ns"]), float(ev["before_ms"]))
                # What the slowdown cost before it was detected.
                lag = max(0, int(ev["detected_index"]) - int(ev["index"]))
                self.episode.loss_ms = lag * max(0.0, float(ev["after_ms"])
                                                 - float(ev["before_ms"]))
            return self._moved(ev)
        if kind == "recovery" and ev.get("scope") == "job":
            e = self.episode
            # Over with the even split in force, no trial running (before any plan,
            # or advise only: the next fault is advised again): back at healthy, or,
            # with no rank named, wherever it recovered to (a busy host's: test_policy).
            back = e is not None and (e.healthy_ms is None or e.straggler is None or
                                      float(ev["after_ms"]) <= e.healthy_ms * (1 + RECOVERED))
            if back and self.planned is None and self._is_even() and e.trial is None:
                self.episode = None
            return self._moved(ev)
        if kind == "diagnosis":
            return self._diagnosis(ev)
        return []

    # -- the episode ------------------------------------------------------------------

    def _begin(self, onset_ns: int, healthy_ms: float | None) -> None:
        self.episode = _Episode(onset_ns, healthy_ms)
        self.advised = None                  # a new episode's advice is news
        self.job_history.clear()
        for r in self.ranks.values():
            r.keep_after(onset_ns)       # speeds from the slow iterations only

    def _moved(self, ev: dict) -> list:
        """The job's speed moved in an episode before any plan: speeds from the new
        level only (a plan on samples of two levels fits neither: test_pipeline)."""
        e = self.episode
        if e is not None and not e.changes and self.planned is None:
            for r in self.ranks.values():
                r.keep_after(int(ev["onset_ns"]))
        return []

    def _diagnosis(self, ev: dict) -> list[Decision]:
        cause, ranks, evidence = ev.get("cause"), ev.get("ranks") or [], ev.get("evidence")
        e = self.episode
        paused = (ev.get("details") or {}).get("paused_s") if evidence == "validation" else None
        if isinstance(paused, (int, float)) and paused > 0:
            self.pause_ms = 1e3 * paused
        if evidence == "validation" and e is not None and e.straggler is not None:
            # Healthy only if this measurement says so, whatever its verdict
            # (that is "unknown" when a link measures slow too).
            if device_healthy(ev.get("details") or {}, e.straggler):
                if self.straggler is not None:
                    # Its device measures healthy now: the fault is gone.
                    return self._end(f"rank {e.straggler}'s device measures healthy again: "
                                     "back to the even split")
                if not e.changes:
                    # Measured healthy before any plan: the passive name was
                    # a busy moment; wait for another verdict.
                    e.named_slow.discard(e.straggler)
                    e.straggler, e.evidence = None, ""
            elif self.straggler is not None and e.recheck_at_ns is not None and \
                    device_slow(ev.get("details") or {}, e.straggler):
                # Measured slow just now: the fault is there; the next
                # recheck (or trial) is a full interval from this answer.
                e.recheck_at_ns = max(e.recheck_at_ns, int(ev["time_ns"])
                                      + int(e.recheck_every_s * 1e9))
        if cause != "computation" or len(ranks) != 1:
            return []
        s = self._dp(int(ranks[0]))
        if e is None:
            # A straggler with no job slowdown: the job was already slow (or
            # the job-level detector missed it). The loss counts from now.
            self._begin(int(ev["time_ns"]), None)
            e = self.episode
        if e.straggler is not None and e.straggler != s and e.evidence == "validation" \
                and evidence == "passive":
            return []                        # a validated verdict outranks a passive one
        e.named_slow.add(s)
        if e.straggler != s or evidence == "validation":
            e.straggler, e.evidence = s, evidence
            if evidence == "validation":
                d = (ev.get("details") or {}).get("devices", {}).get(str(ranks[0]))
                ref = (ev.get("details") or {}).get("gemm_reference_ms")
                if d and ref:
                    e.gemm_ratio = float(d["ms_per_gemm"]) / float(ref)
        return self._decide() if self.planned is None else []

    def _end(self, reason: str) -> list[Decision]:
        out = []
        if not self._is_even():
            out = [self._plan(self._even(), reason, even=True)]
        self.episode = None
        return out

    def _dp(self, rank: int) -> int:
        d = self.announced.get(rank)
        return int(d.get("dp_rank", rank)) if d else rank

    # -- samples ----------------------------------------------------------------------

    def _iteration(self, ev: dict) -> list[Decision]:
        if ev["start_ns"] < self.applied_ns:
            return []
        end = ev["start_ns"] + ev["dur_ns"]
        e = self.episode
        if e is not None and end <= e.onset_ns:
            # A rank's events can arrive late, after another rank's have
            # shown the slowdown: an iteration that ended before the onset
            # is not a sample of the slow speed.
            return []
        rank = int(ev["rank"])
        keep = max(4 * self.window, SAMPLES_KEPT)
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = _Rank(*(deque(maxlen=keep) for _ in range(5)))
            self._lowest = min(self.ranks)      # (asked for every rank's every iteration)
        split = self._current_split()
        dp = self._dp(rank)
        r.end_ns.append(end)
        r.dur_ms.append(ev["dur_ns"] / 1e6)
        r.compute_ms.append(ev["compute_ns"] / 1e6)
        r.count.append(split.get(dp) if split else None)
        r.p2p_ms.append(ev.get("p2p_ns", 0) / 1e6)
        self._now_ns = max(self._now_ns, end)
        if rank != self._lowest:
            return []
        # One job iteration per iteration of the lowest rank.
        job_ms = self.job_ms()
        self.since_plan += 1
        if self.since_plan == 1:
            self.split_from_ns = ev["start_ns"]     # the split's first job iteration
        if job_ms is not None:
            self.job_history.append(job_ms)
        if e is None:
            return []
        if job_ms is not None:
            if e.healthy_ms is None:
                e.healthy_ms = self._healthy_estimate()
            if e.healthy_ms:
                e.loss_ms += max(0.0, job_ms - e.healthy_ms)
        if self.planned is not None:
            if self.since_plan >= 3 * self.window and not self.unapplied_said and \
                    ev["start_ns"] - self.planned_ns > 10e9:
                self.unapplied_said = True
                return [Decision("none", f"plan not applied by every rank after "
                                         f"{self.since_plan} iterations: is the trainer "
                                         "reading the control file?", numbers=self._numbers())]
            return []
        if e.trial is not None:
            e.trial.setdefault("first_ns", ev["start_ns"])
            return self._trial_step()
        if self.since_plan % self.window == 0 or not e.changes:
            return self._decide()
        return []

    def _healthy_estimate(self) -> float | None:
        """Without a slowdown to measure against (the job was already slow): its
        iteration if the straggler computed as fast as the others."""
        e = self.episode
        if e is None or e.straggler is None:
            return None
        comp = {self._dp(rank): statistics.median(r.compute_ms)
                for rank, r in self.ranks.items() if r.compute_ms}
        job = self.recent_job_ms()
        if e.straggler not in comp or len(comp) < 2 or job is None:
            return None
        others = statistics.median(v for k, v in comp.items() if k != e.straggler)
        return max(job - max(0.0, comp[e.straggler] - others), 1e-3)

    def _full(self, n: int) -> bool:
        return bool(self.ranks) and all(len(r.compute_ms) >= n for r in self.ranks.values())

    def _is_even(self, split: dict[int, int] | None = None) -> bool:
        split = split if split is not None else self.split
        if split is None:
            return True
        return sorted(split.values(), reverse=True) == even_split(sum(split.values()), len(split))

    def _current_split(self) -> dict[int, int] | None:
        if self.split is not None:
            return self.split
        if self.global_microbatches and self.world:
            return dict(enumerate(even_split(self.global_microbatches, self.world)))
        return None

    def _even(self) -> dict[int, int]:
        split = self._current_split()
        order = sorted(split)
        return dict(zip(order, even_split(sum(split.values()), len(order))))

    def _speeds(self) -> dict[int, float] | None:
        """dp rank -> its compute per micro-batch."""
        out = {self._dp(rank): r.per_microbatch(self._recent(r)) for rank, r in self.ranks.items()}
        out = {k: max(v, 1e-6) for k, v in out.items() if v is not None}
        split = self._current_split()
        return None if split is None or set(out) != set(split) else out

    # -- decisions --------------------------------------------------------------------

    def _numbers(self, **extra) -> dict:
        e = self.episode
        return {"loss_ms": e.loss_ms if e else 0.0, "healthy_ms": e.healthy_ms if e else None,
                "current_ms": self.job_ms(), **extra}

    def _none(self, why: str) -> list[Decision]:
        e = self.episode
        if e is None or e.said_none == why.split(":")[0]:
            return []
        e.said_none = why.split(":")[0]
        return [Decision("none", why, self.job_ms(), numbers=self._numbers())]

    def _decide(self) -> list[Decision]:
        e = self.episode
        if e is None or self.planned is not None or not self._full(3):
            return []
        # One plan per look: a restart that pays supersedes the rebalance
        # this look would have made (the trainer would otherwise apply one
        # and then, steps later, restart anyway).
        if self.restart_pending:
            return []                  # the job is about to restart: nothing else to plan
        r = self._restart()
        if r is not None:
            r.numbers["supersedes"] = "rebalance_microbatches"
            self.restart_pending = True
            return [r]
        return self._rebalance()

    def _measured(self) -> bool:
        """The split in force has run 2 windows, and trial_min_s on every rank."""
        return self.since_plan >= 2 * self.window and all(
            r.span_ns() >= self.trial_min_ns for r in self.ranks.values())

    def plan_measured(self) -> tuple[bool, str] | None:
        """Does the plan in force confirm its verdict (diagnosis.planner)? Yes when the
        job runs nearer its prediction than the even split's speed in the fault, and
        `min_gain` faster; None until _measured(), a "no" once a refinement was sought."""
        e = self.episode
        if (e is None or self.planned is not None or e.plan_ms is None or not e.even_ms
                or not self._measured() or self._is_even()
                or (got := self.recent_job_ms()) is None):
            return None
        ok = got <= min((e.plan_ms + e.even_ms) / 2, e.even_ms * (1 - self.min_gain))
        if not ok and self.since_plan % self.window:
            return None          # a refinement may come (looked for at whole windows)
        return ok, (f"the job ran {got:.1f} ms per iteration under it (predicted "
                    f"{e.plan_ms:.1f}; {e.even_ms:.1f} at the even split)")

    def _rebalance(self) -> list[Decision]:
        e = self.episode
        split = self._current_split()
        if split is None:
            return self._none("the global micro-batch count is unknown (the trainer announces "
                              "it through the control file, or --microbatches)")
        if e.straggler is None:
            return self._none("no rank is named slower at compute: rebalancing cannot help")
        new_straggler = e.changes and e.planned_for != e.straggler
        if e.changes >= MAX_CHANGES or (e.changes and not new_straggler and (
                e.refined or self._is_even())):
            # Holding the plan in force (or, advise only, the advice given:
            # nothing applied it, so nothing measured it to refine).
            return []
        if self._now_ns - e.onset_ns < self.min_lasted_ns:
            return []                        # a blip so far
        cost_ms = (e.healthy_ms or self.job_ms() or 0.0) + SOLVE_COST_MS
        if not e.changes and e.loss_ms < cost_ms:
            return []                        # the loss grows each iteration: look again
        if e.changes and not new_straggler:
            off = (self.recent_job_ms() or 0.0) > e.plan_ms * (1 + REFINE_OFF)
            if not self._measured() or (e.refine_looked and not off):
                return []                    # looked once, runs as predicted: hold it
            e.refine_looked = True
        t = self._speeds()
        if t is None:
            return []                        # not every rank measured yet
        s = e.straggler
        others = statistics.median(v for k, v in t.items() if k != s)
        if t[s] < others * (1 + MIN_SLOWER):
            if e.gemm_ratio is not None and e.gemm_ratio > 1 + MIN_SLOWER and not e.changes:
                # Host-side compute cannot show a slow device (GPUs): its
                # measured GEMM ratio can.
                t[s] = others * e.gemm_ratio
            elif not e.changes:
                return self._none(f"dp rank {s} is named slow, but its compute per "
                                  f"micro-batch ({t[s]:.2f} ms) is not over the others' "
                                  f"({others:.2f} ms): no split would help")
        order = sorted(split)
        times = [t[k] for k in order]
        counts_now = [split[k] for k in order]
        total = sum(counts_now)
        fixed = [0.0] * len(order)
        if e.changes and not new_straggler and e.at_even:
            times, fixed = two_split_lines(order, t, split, e.at_even)
        # Work goes only onto ranks shown healthy.
        caps = [split[k] if k in e.named_slow else total for k in order]
        try:
            best = solve(times, total, caps=caps, fixed=fixed)
        except RebalanceError as err:
            return self._none(f"no split: {err}")
        now_pred = max(f + n * x for f, n, x in zip(fixed, counts_now, times))
        gain = now_pred / best.makespan - 1
        need = 2 * self.min_gain if e.changes else self.min_gain
        if gain < need or list(best.counts) == counts_now:
            return [] if e.changes else self._none(
                f"the best split gains {gain:.0%}, under {need:.0%}")
        if best.counts[order.index(s)] >= split[s]:
            # The named rank is not the one the speeds would relieve (its
            # node's samples late, another rank busy a moment): moving work
            # between ranks nobody named would be a guess.
            return [] if e.changes else self._none(
                f"dp rank {s} is named slow, but the speeds measured take no work off it")
        counts = dict(zip(order, best.counts))
        if self.advised == counts and self.planned is None and self.split != counts:
            return []                        # advised already (advise only): not again
        if e.changes and not new_straggler:
            e.refined = True
        job_ms = self.recent_job_ms() or now_pred
        expected = max(0.0, job_ms - (now_pred - best.makespan))
        what = "refine" if e.changes else "rebalance"
        reason = (f"dp rank {s} takes {t[s]:.2f} ms per micro-batch against a median of "
                  f"{others:.2f}: {what}" + (f" ({e.evidence} verdict)" if e.evidence else ""))
        if not e.changes:
            e.even_ms = job_ms
            # Each rank's (micro-batches, mean compute) here: with the same
            # under the plan, two points of its time against its work.
            e.at_even = {k: (split[k], t[k] * split[k]) for k in order}
        e.changes += 1
        e.plan_ms, e.planned_for = expected, s
        e.recheck_at_ns = self._now_ns + int(RECHECK_AFTER_S * 1e9)
        return [self._plan(counts, reason, expected=expected, cost_ms=cost_ms,
                           predicted_compute_ms=best.makespan, compute_now_ms=now_pred)]

    def _plan(self, counts: dict[int, int], reason: str, expected: float | None = None,
              even: bool = False, **numbers) -> Decision:
        self.planned = dict(counts)
        self.planned_ns = self._now_ns
        self.unapplied_said = False
        if expected is None:
            expected = self.recent_job_ms()
        return Decision("rebalance_microbatches", reason, expected, {"microbatches": dict(counts)},
                        self._numbers(solve_ms=None, **numbers))

    def _restart(self) -> Decision | None:
        """S3/S4, when the trainer can checkpoint and the loss pays for a restart."""
        e = self.episode
        if not self.allow_restart or e is None or e.restart_considered or e.healthy_ms is None:
            return None
        # The iteration now: the recent median (one iteration's is noise).
        d = restart_decision(self.announced, self.ranks, self._speeds(), self._current_split(),
                             self.recent_job_ms() or self.job_ms(), e.healthy_ms, e.loss_ms,
                             self.restart_cost(),
                             self.min_gain, recent=4 * self.window)
        if d is not None:
            e.restart_considered = True
            d.numbers = {**self._numbers(), **d.numbers}
        return d
