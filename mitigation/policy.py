"""When to act on a slowdown, and how: a ski-rental policy over S1..S4.

The policy reads the same events every other consumer reads (`iteration`,
`slowdown`, `recovery`) plus what the trainer announced in its acks, and
returns Decisions; it does no I/O, so the live session, replays and tests
drive it the same way.

The rule (ski rental: rent until the rent paid equals the price, then buy):

- The *loss* of a slowdown is the time it has cost so far, sum over
  iterations of (iteration time - healthy iteration time), counted from the
  onset the detector reports.
- Each strategy has a *cost*: S2 (rebalance micro-batches) about one
  iteration plus the solver's time; S3 (pipeline re-split) and S4
  (checkpoint-restart) the restart time as observed by the supervisor, or
  `restart_estimate_s` until one has been observed.
- A strategy is taken when the loss it would have avoided reaches its cost,
  and only if it is predicted to help (at least `min_gain` faster). S2 is
  cheap, so it happens once the slowdown has lasted `min_lasted_s` (1 s;
  a shorter one is a blip of a busy host: S1, do nothing); S3/S4 need the
  slowdown to persist until its remaining loss (what S2 could not win back)
  pays for a restart.
- While a plan is in force the per-rank speeds are re-measured every
  `window` iterations; when the best split differs from the one in force by
  more than `min_gain` (for example the slow rank recovered) a new plan is
  issued, down to the even split.

Per-rank speed comes from passive evidence: a data-parallel rank's compute
time per iteration (iteration time minus its time blocked in collectives)
over the micro-batches it runs is its time per micro-batch.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from greyhound_bpf.events import is_speed_sample

from .rebalance import RebalanceError, even_split, greedy_makespan, solve
from .resplit import resplit

RESTART_ESTIMATE_S = 60.0
# A slowdown is a blip, and gets no plan, until it has lasted this long (as
# for the passive diagnosis: a busy host slows a rank for a moment).
MIN_LASTED_S = 1.0
# A slowdown is over when the job is back within this of its healthy speed.
RECOVERED = 0.15
# What solving for a new split costs, in the ski-rental sum: the solver's
# time at 1,024 data-parallel ranks (scripts/bench_rebalance: 22.6 ms). A
# constant, not the measured time: the policy is part of a pure analysis,
# whose replay must decide the same.
SOLVE_COST_MS = 25.0


@dataclass
class Decision:
    strategy: str                 # none / rebalance_microbatches / reconfigure_pipeline / checkpoint_restart
    reason: str
    expected_ms: float | None = None
    plan: dict = field(default_factory=dict)      # ControlWriter.issue keyword arguments
    numbers: dict = field(default_factory=dict)   # the figures behind the decision

    def fields(self) -> dict:
        return {"strategy": self.strategy, "reason": self.reason,
                "expected_ms": None if self.expected_ms is None else round(self.expected_ms, 3),
                "plan": {k: ({str(r): n for r, n in v.items()} if isinstance(v, dict) and
                             k == "microbatches" else v) for k, v in self.plan.items()},
                **{k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in self.numbers.items()}}


@dataclass
class _Rank:
    dur_ms: deque
    compute_ms: deque
    end_ns: deque
    last_ns: int = 0

    def keep_after(self, t_ns: int) -> None:
        """Drop the samples of iterations that ended by t_ns."""
        rows = [x for x in zip(self.end_ns, self.dur_ms, self.compute_ms) if x[0] > t_ns]
        for q in (self.end_ns, self.dur_ms, self.compute_ms):
            q.clear()
        for e, d, c in rows:
            self.end_ns.append(e)
            self.dur_ms.append(d)
            self.compute_ms.append(c)


class SkiRentalPolicy:
    def __init__(self, *, global_microbatches: int | None = None, world: int | None = None,
                 window: int = 8, min_gain: float = 0.05, min_slower: float = 0.25,
                 restart_estimate_s: float = RESTART_ESTIMATE_S, allow_restart: bool = True,
                 min_lasted_s: float = MIN_LASTED_S):
        self.window, self.min_gain, self.min_slower = window, min_gain, min_slower
        self.min_lasted_ns = int(min_lasted_s * 1e9)
        self.global_microbatches, self.world = global_microbatches, world
        self.restart_estimate_s = restart_estimate_s
        self.restart_observed_s: float | None = None
        self.allow_restart = allow_restart
        self.ranks: dict[int, _Rank] = {}
        self.announced: dict[int, dict] = {}      # rank -> its last ack document
        self.split: dict[int, int] | None = None  # dp_rank -> micro-batches now in force
        self.planned: dict[int, int] | None = None  # issued, not yet applied by every rank
        self.slow = False
        self.healthy_ms: float | None = None
        self.loss_ms = 0.0
        self.since_plan = 0                       # job iterations since the last plan applied
        self.restart_considered = False
        self.said_none = False
        self.last_plan: dict[int, int] | None = None
        self.job_history: deque = deque(maxlen=window)   # job iteration times (ms)
        self.pending = False                           # decide once enough slow samples
        self.straggler: int | None = None              # dp rank the plan in force works around
        self._last_verdict: int | None = None          # slowest rank at the last look (or None)
        self._streak = 0                               # looks in a row with that verdict
        self._next_look = 1                            # iterations before a pending look
        self._confirming = False
        self.planned_ns = 0                            # when the plan in flight was made
        self.applied_ns = 0                            # when the plan in force was applied
        self.unapplied_said = False
        self._now_ns = 0
        self.onset_ns = 0                          # the slowdown's onset

    # -- inputs ---------------------------------------------------------------------

    def acks(self, docs: dict[int, dict]) -> None:
        """The trainer's acks (ControlWriter.ack_docs()): the split in force."""
        self.announced = docs
        counts = {}
        for d in docs.values():
            n, dp = d.get("microbatches"), d.get("dp_rank", d.get("rank"))
            if isinstance(n, int) and isinstance(dp, int):
                counts[dp] = n
        if counts and (self.world is None or len(counts) == self.world):
            self.split = counts
            self.world = len(counts)
            self.global_microbatches = sum(counts.values())
        if self.planned is not None and self.split == self.planned:
            self.planned = None
            self.since_plan = 0
            self._reset_windows()
            # Iterations that started before the last rank applied the plan
            # still ran the old split (the tracer reports them late).
            self.applied_ns = max((int(d.get("applied_ns", 0)) for d in docs.values()),
                                  default=0)

    def withdraw(self) -> None:
        """Advise-only mode: the plan was reported, not written; do not
        wait for acks of it."""
        self.planned = None

    def restart_cost(self) -> tuple[float, str]:
        if self.restart_observed_s is not None:
            return self.restart_observed_s, "observed"
        return self.restart_estimate_s, "estimated"

    def observe(self, ev: dict) -> list[Decision]:
        kind = ev.get("kind")
        if is_speed_sample(ev):
            return self._iteration(ev)
        if kind == "slowdown" and ev.get("scope") == "job":
            if not self.slow:
                self.slow = True
                self.healthy_ms = float(ev["before_ms"])
                self.said_none = False
                self.restart_considered = False
                self.onset_ns = int(ev["onset_ns"])
                # Job times from before the detection would read as a
                # recovery at the next iteration: start over.
                self.job_history.clear()
                # What the slowdown cost before it was detected.
                lag = max(0, int(ev["detected_index"]) - int(ev["index"]))
                self.loss_ms = lag * max(0.0, float(ev["after_ms"]) - self.healthy_ms)
                # Speeds from the slow iterations only.
                for r in self.ranks.values():
                    r.keep_after(int(ev["onset_ns"]))
                if self._full(3):
                    return self._decide()
                self.pending = True
        if kind == "recovery" and ev.get("scope") == "job" and self.planned is None:
            # A faster level is not a recovery until it is back near the
            # healthy speed: a slowdown can ease from 2x to 1.5x and go on.
            back = self.healthy_ms is None or \
                float(ev["after_ms"]) <= self.healthy_ms * (1 + RECOVERED)
            if back and (self.split is None or self._is_even(self.split)):
                self.slow = False
                self.loss_ms = 0.0
                self.pending = False
        return []

    # -- state ------------------------------------------------------------------------

    def _reset_windows(self) -> None:
        for r in self.ranks.values():
            r.dur_ms.clear()
            r.compute_ms.clear()

    def _iteration(self, ev: dict) -> list[Decision]:
        if ev["start_ns"] < self.applied_ns:
            return []
        if self.slow and ev["start_ns"] + ev["dur_ns"] <= self.onset_ns:
            # A rank's events can arrive late, after another rank's have
            # already shown the slowdown: an iteration that ended before
            # the onset is not a sample of the slow speed (keep_after).
            return []
        rank = int(ev["rank"])
        keep = 4 * self.window
        r = self.ranks.setdefault(rank, _Rank(deque(maxlen=keep), deque(maxlen=keep),
                                              deque(maxlen=keep)))
        r.dur_ms.append(ev["dur_ns"] / 1e6)
        r.compute_ms.append(ev["compute_ns"] / 1e6)
        r.last_ns = ev["start_ns"] + ev["dur_ns"]
        r.end_ns.append(r.last_ns)
        self._now_ns = max(self._now_ns, r.last_ns)
        if rank != min(self.ranks):
            return []
        # One job iteration per iteration of the lowest rank.
        job_ms = self.job_ms()
        if job_ms is not None:
            self.job_history.append(job_ms)
        if self.slow and job_ms is not None and self.healthy_ms:
            self.loss_ms += max(0.0, job_ms - self.healthy_ms)
        self.since_plan += 1
        if self.planned is not None:
            if self.since_plan >= 3 * self.window and not self.unapplied_said and \
                    ev["start_ns"] - self.planned_ns > 10e9:
                self.unapplied_said = True
                return [Decision("none", f"plan not applied by every rank after "
                                         f"{self.since_plan} iterations: is the trainer "
                                         "reading the control file?", numbers=self._numbers())]
            return []
        even_now = self.split is None or self._is_even(self.split)
        if (self.slow and even_now and self.healthy_ms and len(self.job_history) == self.window
                and self.since_plan >= self.window
                and statistics.median(self.job_history) <= self.healthy_ms * (1 + self.min_gain)):
            self.slow = False        # back to healthy speed on the even split
            self.loss_ms = 0.0
            return []
        if self.pending and self.since_plan >= self._next_look and self._full(3):
            self.pending = False
            return self._decide()
        if self.slow and even_now:
            # Slow and nothing done yet: look again every window.
            if self.since_plan >= self.window and self._full(self.window):
                return self._decide()
        elif not even_now:
            # A plan in force: look again every 4 windows, over the samples
            # taken since it was applied.
            if self.since_plan >= 4 * self.window and self._full(4 * self.window):
                return self._decide()
        return []

    def _full(self, n: int | None = None) -> bool:
        n = self.window // 2 if n is None else n
        return bool(self.ranks) and all(len(r.compute_ms) >= n for r in self.ranks.values())

    def recent_job_ms(self) -> float | None:
        """Job iteration time over the current samples (since the onset of
        a slowdown, or since the plan in force was applied): the median
        over ranks of each rank's median."""
        meds = [statistics.median(r.dur_ms) for r in self.ranks.values() if r.dur_ms]
        return statistics.median(meds) if meds else None

    def job_ms(self) -> float | None:
        lasts = [r.dur_ms[-1] for r in self.ranks.values() if r.dur_ms]
        return statistics.median(lasts) if lasts else None

    def _is_even(self, split: dict[int, int]) -> bool:
        return sorted(split.values(), reverse=True) == even_split(sum(split.values()), len(split))

    def _current_split(self) -> dict[int, int] | None:
        if self.split is not None:
            return self.split
        if self.global_microbatches and self.world:
            return dict(enumerate(even_split(self.global_microbatches, self.world)))
        return None

    # -- decisions ------------------------------------------------------------------

    def _decide(self) -> list[Decision]:
        out = []
        d = self._rebalance()
        if d is not None:
            out.append(d)
        elif self.slow and not self.said_none and not self._confirming:
            out.append(self._none())
        r = self._restart()
        if r is not None:
            out.append(r)
        self.since_plan = 0
        return out

    def _none(self) -> Decision:
        self.said_none = True
        why = self._why_not_rebalance or "nothing predicted to help yet"
        return Decision("none", why, self.job_ms(), numbers=self._numbers())

    _why_not_rebalance: str | None = None

    def _numbers(self, **extra) -> dict:
        return {"loss_ms": self.loss_ms, "healthy_ms": self.healthy_ms,
                "current_ms": self.job_ms(), **extra}

    def _samples(self, split: dict[int, int]) -> dict[int, list[float]] | None:
        """dp rank -> its recent times per micro-batch (compute / count)."""
        dp_of = {rank: d.get("dp_rank", rank) for rank, d in self.announced.items()}
        out = {}
        for rank, r in self.ranks.items():
            dp = dp_of.get(rank, rank)
            if dp in split and r.compute_ms:
                out[dp] = [max(c, 1e-6) / split[dp] for c in r.compute_ms]
        return out if set(out) == set(split) else None

    def _per_microbatch(self, split: dict[int, int]) -> dict[int, float] | None:
        s = self._samples(split)
        return None if s is None else {k: statistics.median(v) for k, v in s.items()}

    def _significantly_slow(self, samples: dict[int, list[float]]) -> int | None:
        """The rank that is slower at compute beyond noise: its median time
        per micro-batch is `min_slower` (25%) over the other ranks' pooled
        median, and at least 80% of its samples lie above that median.
        Per-iteration samples vary by 10-30% on a busy node, ranks differ
        by a few percent for good (rank 0 often does a little more), and on
        a shared 2-core host one rank runs 15-20% slower for seconds at a
        time (the diagnosis names nothing under 25% either): none is a
        fail-slow worth a plan."""
        med = {k: statistics.median(v) for k, v in samples.items()}
        worst = max(med, key=med.get)
        others = [x for k, v in samples.items() if k != worst for x in v]
        if not others:
            return None
        ref = statistics.median(others)
        above = sum(x > ref for x in samples[worst]) / len(samples[worst])
        if med[worst] > ref * (1 + self.min_slower) and above >= 0.8:
            return worst
        return None

    def _rebalance(self) -> Decision | None:
        self._why_not_rebalance = None
        split = self._current_split()
        if split is None:
            self._why_not_rebalance = ("the global micro-batch count is unknown (the trainer "
                                       "announces it through the control file, or --microbatches)")
            return None
        samples = self._samples(split)
        if samples is None:
            self._why_not_rebalance = "not every data-parallel rank is measured yet"
            return None
        t = {k: statistics.median(v) for k, v in samples.items()}
        order = sorted(split)
        times = [t[k] for k in order]
        counts_now = [split[k] for k in order]
        total = sum(counts_now)
        now_pred = max(n * x for n, x in zip(counts_now, times))
        slowest = self._significantly_slow(samples)
        # Persistence: the same verdict on two looks in a row (each over
        # its own window of samples) before a plan changes. Ranks of a job
        # on a busy node take turns being slower for a window or two.
        verdict = slowest
        self._streak = self._streak + 1 if verdict == self._last_verdict else 1
        self._last_verdict = verdict
        self._confirming = self._streak < 2
        if self._confirming:
            self.pending = True
            self._next_look = max(1, self.window // 2)
            self._why_not_rebalance = ("confirming: " + ("no rank is slower at compute"
                                       if slowest is None else f"dp rank {slowest} looks slow"))
            return None
        if not self.slow and self._is_even(split):
            # No slowdown in progress: nothing to win back, whatever one
            # window of samples says (the ski-rental loss is zero).
            self._why_not_rebalance = "no slowdown in progress"
            return None
        if slowest is None:
            if not self._is_even(split):
                # The rank that was slow is not any more: back to even.
                even = dict(zip(order, even_split(total, len(order))))
                even_pred = max(even[k] * t[k] for k in order)
                self.straggler = None
                return self._plan(even, now_pred, even_pred,
                                  "no rank is slower at compute any more: back to the even split")
            self._why_not_rebalance = ("no rank is slower at compute beyond noise: "
                                       "rebalancing cannot help")
            return None
        try:
            best = solve(times, total)
            solve_ms = SOLVE_COST_MS
        except RebalanceError as e:
            self._why_not_rebalance = f"no split: {e}"
            return None
        gain = now_pred / best.makespan - 1
        if self.last_plan == dict(zip(order, best.counts)) and self.planned is None \
                and self.split != self.last_plan:
            return None          # advised already (advise-only mode): not again
        # Hysteresis: a new split must be clearly better than the one running,
        # twice as clearly when it only refines a plan already in force.
        need = self.min_gain if self._is_even(split) else 2 * self.min_gain
        if gain < need or list(best.counts) == counts_now:
            self._why_not_rebalance = f"the best split gains {gain:.0%}, under {need:.0%}"
            return None
        job_ms = self.job_ms() or now_pred
        iteration_ms = self.healthy_ms or job_ms
        cost_ms = iteration_ms + solve_ms
        lasted_ns = self._now_ns - self.onset_ns
        if self.slow and lasted_ns < self.min_lasted_ns:
            self.pending = True        # a blip so far: look again
            self._next_look = 1
            self._why_not_rebalance = (f"the slowdown has lasted {lasted_ns / 1e9:.1f} s, under "
                                       f"{self.min_lasted_ns / 1e9:.1f} s: a blip so far")
            return None
        if self.slow and self.loss_ms < cost_ms:
            self.pending = True        # the loss grows each iteration: look again
            self._next_look = 1
            self._why_not_rebalance = (f"loss so far {self.loss_ms:.0f} ms is under the cost of a "
                                       f"rebalance ({cost_ms:.0f} ms): waiting")
            return None
        self.straggler = slowest
        reason = (f"dp rank {slowest} takes {t[slowest]:.2f} ms per micro-batch against a median "
                  f"of {statistics.median(times):.2f}: rebalance")
        return self._plan(dict(zip(order, best.counts)), now_pred, best.makespan,
                          reason, cost_ms=cost_ms)

    def _plan(self, counts, now_pred, new_pred, reason, cost_ms=None) -> Decision:
        job_ms = self.recent_job_ms() or now_pred
        # The solver predicts compute time; the iteration keeps its other parts.
        expected = max(0.0, job_ms - (now_pred - new_pred))
        self.planned = dict(counts)
        self.planned_ns = self._now_ns
        self.unapplied_said = False
        self.last_plan = dict(counts)
        self.said_none = True          # this slowdown has its answer
        return Decision("rebalance_microbatches", reason, expected,
                        {"microbatches": dict(counts)},
                        self._numbers(cost_ms=cost_ms, solve_ms=None,
                                      predicted_compute_ms=new_pred,
                                      compute_now_ms=now_pred))

    def _restart(self) -> Decision | None:
        """S3/S4, when the trainer can checkpoint and the loss pays for a restart."""
        if not self.allow_restart or not self.slow or self.restart_considered:
            return None
        if not any(d.get("checkpoint") for d in self.announced.values()):
            return None
        if self.healthy_ms is None:
            return None
        cost_s, how = self.restart_cost()
        stages = {d.get("stage") for d in self.announced.values()} - {None}
        layer_split = next((d.get("layer_split") for d in self.announced.values()
                            if d.get("layer_split")), None)
        job_ms = self.job_ms()
        if job_ms is None:
            return None
        if layer_split and len(stages) == len(layer_split) > 1:
            # Pipeline: a stage is as slow as its slowest replica.
            stage_ms = []
            for s in range(len(layer_split)):
                ms = [statistics.median(r.compute_ms) for rank, r in self.ranks.items()
                      if r.compute_ms and self.announced.get(rank, {}).get("stage") == s]
                if not ms:
                    return None
                stage_ms.append(max(ms))
            rs = resplit(stage_ms, layer_split)
            best_now = max(stage_ms)
            saved = best_now - rs.makespan
            strategy, plan = "reconfigure_pipeline", {"layer_split": list(rs.split),
                                                     "restart": {"checkpoint": True}}
            what = f"re-split layers {list(layer_split)} -> {list(rs.split)}"
        else:
            split = self._current_split()
            t = self._per_microbatch(split) if split else None
            if t is None or len(t) < 2:
                return None
            order = sorted(split)
            total = sum(split.values())
            times = [t[k] for k in order]
            med = statistics.median(times)
            best_now = greedy_makespan(times, total)
            # Exclude ranks slower than 2x the median when the others carry
            # the global batch faster than the best split with them.
            keep = [i for i, x in enumerate(times) if x <= 2 * med]
            if len(keep) == len(times) or not keep or total < len(keep):
                return None
            kept = [times[i] for i in keep]
            without = greedy_makespan(kept, total)
            saved = best_now - without
            excluded = [order[i] for i in range(len(order)) if i not in keep]
            strategy, plan = "checkpoint_restart", {"restart": {"checkpoint": True,
                                                                "exclude": excluded}}
            what = f"restart without dp rank(s) {excluded}"
        if saved <= self.min_gain * best_now:
            return None
        # Rent until the loss the restart would have avoided pays for it.
        avoidable_ms = self.loss_ms * min(1.0, saved / max(job_ms - (self.healthy_ms or 0), 1e-9))
        if avoidable_ms < cost_s * 1e3:
            return None
        self.restart_considered = True
        return Decision(strategy, f"{what}: {avoidable_ms / 1e3:.1f} s lost reached the "
                                  f"{how} restart cost of {cost_s:.1f} s",
                        max(0.0, job_ms - saved), plan,
                        self._numbers(cost_ms=cost_s * 1e3, cost=how, saved_ms=saved))
