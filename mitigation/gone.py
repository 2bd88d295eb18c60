"""Is the fault gone? The part of the policy (mitigation.policy) that
decides it from evidence that does not depend on the plan in force: a
recheck of the straggler's device, or a trial return to the even split,
whichever costs the job less.

A recheck stops the whole job for the length of a validation pause (the
last one measured); a trial only runs it at the even split's slow speed for
a moment: `window` iterations and at least `trial_min_s`. Where the trial
costs less, it is had instead (on a fast job it costs tens of times less).
A trial is judged by the mean of its iterations (under a CFS quota a fast
job's iterations are fast, or stalled for the rest of the quota's period,
and their median reads healthy while the job runs slow). It chooses between
two answers, each with the even split's speed it predicts: the fault is
gone (healthy) or it lasts (the even split's mean in the fault, measured
when the first plan was made, and again by each trial that finds it
lasting). The even split stays when the trial runs
nearer healthy than the fault, or within RECOVERED of healthy, or faster
than the plan's own mean since it was applied (whatever healthy was
measured as, the plan no longer pays); but where only the first of those
holds and the job still runs over RECOVERED above healthy, the ranks' own
compute at the even split decides too: equal work, so a straggler that
still computes STILL_SLOW more than the others is the fault, whatever the
job's mean (the even split's level in the fault is one reading, from when
the first plan was made, and a quota's moment can sit far from it:
bench_mitigation, a trial at 34.9 ms against 62.9 in the fault and 19.8
healthy, rank 1 computing 27-37 ms to rank 0's 10-12). Only that way: on
a GPU, host-side compute cannot show a slow device, so equal compute is no
sign the fault is gone. Healthy is the detector's level from
before the fault: a noisy job's mean runs above it, and the host may be
busier now, so a fixed margin over it alone reads a busier moment as the
fault (CI's demo: 25.0 ms against 21.2 healthy and 34 in the fault). A
wrong "gone" costs one re-plan (the cross-section names the straggler
again, no change point needed); a wrong "lasts", the plan until the next
trial.

How often to look is a ski rental. Each look costs the job something
while the fault lasts (a trial's span at the even split's slow speed, or
a recheck's pause); not looking costs it the plan held after the fault has
gone, up to one interval of it, at most (plan - healthy) / plan of each
second (the plan's split runs no slower once the straggler is healthy,
the even split at healthy). So the interval stays RECHECK_AFTER_S until
the looks at it have cost as much as holding the plan one interval too
long would, and only then doubles (to RECHECK_MAX_S): however long the
fault, the looks have then cost the job at most about twice what holding
the plan one interval past it can. It doubled after every look before,
and in bench_mitigation, whose 40 s fault gets one look, the plan
outlived the fault by 25-27 s at +30% (the second look 40 s after the
first), where a look cost the job about a twentieth of that.
"""
from __future__ import annotations

import statistics

from greyhound_bpf.diagnosis.planner import RECHECK_PAUSE_S

from .restart import Decision

# A slowdown is over when the job is back within this of its healthy speed.
RECOVERED = 0.15
# Is the fault gone? A look (a recheck of the straggler's device, or a
# trial) RECHECK_AFTER_S after the plan was applied (mitigation.episode),
# then at that interval or doubling ones (a ski rental: the docstring), up to
RECHECK_MAX_S = 320.0
# How a trial that keeps the even split ends its reason (readers such as
# scripts/demo_story.py find the decision by it).
EVEN_STAYS = "the fault is gone, the even split stays"
# How a trial's own plan (the even split, for a moment) begins its reason.
TRIAL = "trial: is the fault gone?"
# A trial at the even split lasts at least this long: ten periods of the
# CFS quota (100 ms), whose bursts make a fast job's iterations fast or
# stalled (a 40 s fault at 8 ms per iteration: ~12 in a burst).
TRIAL_MIN_S = 1.0
# At the even split (a trial), a straggler whose compute per micro-batch is
# this much over the others' median is still slow.
STILL_SLOW = 0.5


class FaultGone:
    """Mixed into SkiRentalPolicy: reads its episode, split, samples and
    settings (window, validate, trial_min_ns, pause_ms), and plans with its
    _plan and _even."""

    def recheck_due(self, now_ns: int) -> int | None:
        """The rank whose device should be measured again now (is the fault
        that the plan in force works around gone?), or None."""
        e = self.episode
        if (e is None or not self.validate or e.recheck_at_ns is None
                or now_ns < e.recheck_at_ns or self.straggler is None):
            return None
        trial, pause = self._trial_cost_ms(), self._pause_ms()
        cheaper = trial is not None and trial < pause
        self._next_look(now_ns, trial if cheaper else pause)
        if cheaper:
            e.trial_due_ns = now_ns          # cheaper than stopping the job to measure
            return None
        return e.straggler

    def _next_look(self, now_ns: int, cost_ms: float | None) -> None:
        """Schedule the look after this one, which costs the job `cost_ms`
        while the fault lasts: at the same interval until the looks there
        cost as much as holding the plan one interval past the fault, then
        at twice it (the module's docstring). Where either cost is unknown,
        at twice it at once."""
        e = self.episode
        hold = self._hold_share()
        e.looks_ms += cost_ms or 0.0
        if cost_ms is None or hold is None or e.looks_ms >= hold * e.recheck_every_s * 1e3:
            e.recheck_every_s = min(RECHECK_MAX_S, 2 * e.recheck_every_s)
            e.looks_ms = 0.0
        e.recheck_at_ns = now_ns + int(e.recheck_every_s * 1e9)

    def _hold_share(self) -> float | None:
        """What each second of the plan held after the fault has gone costs
        the job, at most: (plan - healthy) / plan, from the plan's
        prediction in the fault and the job's healthy time."""
        e = self.episode
        if not e.healthy_ms or not e.plan_ms or e.plan_ms <= e.healthy_ms:
            return None
        return (e.plan_ms - e.healthy_ms) / e.plan_ms

    def _pause_ms(self) -> float:
        """What a recheck would pause the job for: the last validation's
        pause, or (none measured: a plan confirmed the verdict) a recheck's
        expected one, its workers' start not even counted."""
        return self.pause_ms if self.pause_ms is not None else RECHECK_PAUSE_S * 1e3

    def _trial_cost_ms(self) -> float | None:
        """What a trial at the even split would cost the job while the fault
        lasts: its span at the even split's (slow) speed, less the plan's."""
        e = self.episode
        if e is None or not e.even_ms or e.plan_ms is None:
            return None
        span = max(self.window * e.even_ms, self.trial_min_ns / 1e6)
        return span * max(0.0, e.even_ms - e.plan_ms) / e.even_ms

    def _trial_step(self) -> list[Decision]:
        """A trial return to the even split: judged after a window of
        iterations at the even split spanning at least trial_min_s, by their
        mean (CFS bursts: the median of fast-or-stalled iterations reads
        healthy while the job runs slow)."""
        e = self.episode
        trial = e.trial
        span = self._now_ns - trial["first_ns"]
        if self.since_plan < self.window or span < self.trial_min_ns:
            return []
        e.trial = None
        got = span / 1e6 / self.since_plan
        plan_ms = trial.get("plan_ms")
        near = e.healthy_ms and e.healthy_ms * (1 + RECOVERED)
        bar = max(near, (e.healthy_ms + e.even_ms) / 2) if near and e.even_ms else near
        still = self._still_slower()
        still = still if still is not None and still >= 1 + STILL_SLOW else None
        if (near and got <= near) or (plan_ms and got < plan_ms) or \
                (still is None and bar and got <= bar):
            # Within RECOVERED of healthy, or the even split now runs faster
            # than the plan did (both means: the plan no longer pays), or
            # nearer healthy than the fault with no rank still computing
            # STILL_SLOW more than the others: it stays.
            self.episode = None
            return [Decision("none", f"trial at the even split ran {got:.1f} ms per iteration"
                             + (f" (healthy {e.healthy_ms:.1f}, in the fault "
                                f"{e.even_ms:.1f})" if e.healthy_ms and e.even_ms else "")
                             + (f" (the plan {plan_ms:.1f})" if plan_ms else "")
                             + f": {EVEN_STAYS}", got)]
        # The fault lasts, and the trial has just measured the even split in
        # it: that level, not the one read at the first plan, is what the
        # next look will cost (bench_mitigation: 22.2 ms read at the first
        # plan, a trial at 38.7-48, a look costed at a fifth of what it was).
        e.even_ms = got
        if not self.validate:                # (with it on, recheck_due scheduled it)
            self._next_look(self._now_ns, self._trial_cost_ms())
        why = (f", dp rank {e.straggler} computing x{still:.2f} the others' there"
               if still is not None else "")
        return [self._plan(trial["plan"], f"trial at the even split ran {got:.1f} ms per "
                           f"iteration (healthy {e.healthy_ms:.1f}{why}): the fault lasts, "
                           "the plan returns", trial["expected_ms"])]

    def _still_slower(self) -> float | None:
        """The straggler's compute per micro-batch over the others' median,
        from the trial's samples (the split's change cleared the earlier
        ones); None where that cannot be read: no samples, or several ranks
        per dp rank (a pipeline's stages compute unlike amounts)."""
        e = self.episode
        comp = {self._dp(r): x.per_microbatch() for r, x in self.ranks.items()}
        if e.straggler not in comp or len(comp) != len(self.ranks):
            return None
        mine, others = comp.pop(e.straggler), [c for c in comp.values() if c]
        return mine / statistics.median(others) if mine and others else None

    def recheck_refused(self, now_ns: int) -> None:
        """The recheck could not be had (the validation budget): a trial
        return to the even split is due instead."""
        e = self.episode
        if e is not None:
            e.trial_due_ns = now_ns

    def trial_due(self, now_ns: int) -> list[Decision]:
        """A trial return to the even split, when due: with validation off,
        on the recheck schedule; with it on, when a recheck was refused."""
        e = self.episode
        if (e is None or self.planned is not None or e.trial is not None
                or self.straggler is None):
            return []
        if self.validate:
            if e.trial_due_ns is None or now_ns < e.trial_due_ns:
                return []
            e.trial_due_ns = None
        elif e.recheck_at_ns is None or now_ns < e.recheck_at_ns:
            return []
        # The plan's own mean iteration since it was applied: the trial
        # keeps the even split if it runs faster than that.
        plan_ms = ((self._now_ns - self.split_from_ns) / 1e6 / self.since_plan
                   if self.split_from_ns is not None and self.since_plan else None)
        e.trial = {"plan": dict(self.split), "expected_ms": e.plan_ms, "plan_ms": plan_ms}
        cost, why, pause = self._trial_cost_ms(), "", self._pause_ms()
        if self.validate and cost is not None and cost < pause:
            why = f" (about {cost:.0f} ms of the job's time, a recheck's pause {pause:.0f})"
        return [self._plan(self._even(), f"{TRIAL} the even split for "
                           f"{self.window} iterations and "
                           f"{self.trial_min_ns / 1e9:g} s{why}")]
