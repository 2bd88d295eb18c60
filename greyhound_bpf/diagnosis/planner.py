"""When to validate: validation pauses the job, so it is asked for only when
it can change what is known, and within a budget. Pure: the analysis feeds
it verdicts, the job's slowdown events, pause spans and the time, and it
answers with requests (`validation` events) that the validator serves.

- A passive verdict is validated while its slowdown lasts, or whenever it
  names a rank's computation (a rebalance hides a slow rank, it does not
  fix it); one naming communication after its slowdown is over is not (a
  link that recovered measures healthy: a healthy 2-rank job's 1.4 s blip,
  judged at its recovery, had its workers started and the job paused). One
  less than the passive rules' minimum (`below_min_ratio`) is not, unless
  the job's own slowdown is DISAGREE_RATIO or more: then the passive
  windows missed the fault (its onset placed late, the "before" already
  slow) and the verdict counts as naming nothing (validated if it lasts).
- A verdict that names nothing is validated only once its slowdown has
  lasted PERSIST_S: a busy host's episodes pass in seconds (they are most
  such verdicts), a fault lasts (a slow link, which looks like every rank
  waiting longer, included). One that suspects a cause it does not name
  yet (`details.suspected_cause`: every rank waits longer in its collectives,
  which the passive rules name only once it lasts) is validated as a named
  one: the measurement, not the wait, tells a slow link from a busy host.
- A slowdown whose fault validation has already named is not validated
  again on a further verdict of it that names nothing, and a verdict that
  names what the last validation named (the same cause, ranks and link)
  within `window_s` is not validated again (`phase: skipped`): under a plan
  the detector sees the job slow down and recover as the split changes,
  and each new look at the same fault would pause the job again for an
  answer already had (bench_mitigation: a second validation of rank 1 12 s
  after the first, 2.6 s more of pauses in a 40 s fault). A validation that
  names anything else, or nothing, forgets it. While it is known, a verdict
  naming something else is validated only if its slowdown lasts PERSIST_S,
  as one naming nothing: the same fault can look otherwise to the passive
  rules (a rank under a CPU quota stalls inside its collectives too, and
  every rank then waits longer: "communication"; bench_mitigation
  validated that 14 s after the first validation, 2.7 s more of pauses).
- After a validation that names nothing, the next one waits BACKOFF_S,
  doubling up to BACKOFF_MAX_S; a verdict that names a rank is validated at
  once (the budget still applies), and one that names something resets it.
- The pause budget: validation pauses the job for at most `budget` (1%) of
  wall time over any `window_s` (10 minutes). A request that would exceed
  it waits until it would not, while its reason still holds.
- A passive verdict that a plan (`--mitigate`) already acts on by moving
  work off the rank it names is held (`phase: deferred`) while the plan is
  measured: the plan is itself the test, an intervention. If the job then
  runs nearer the plan's prediction than the even split's speed, and 5%
  faster than that, the rank was the one slow at computation (moving
  micro-batches cannot speed up a slow link, a busy host or another rank's
  fault: the job would run as at the even split), and the measurement would
  only say it again, at the price of starting the workers (torch imports
  beside the running job: it ran 23 ms per iteration there against 14.5
  after, bench_mitigation) and a pause of the whole job: `phase: skipped`,
  and what it named counts as known. If not, or with no answer in
  PLAN_HOLD_S, it is validated as any other.
- A verdict that names nothing never takes the place of a waiting one that
  names something: it says less, and the named one's validation measures
  every device and link anyway. (In a CI run of the demo, the fault's onset
  gave a verdict naming nothing just after the one naming rank 2 that plan
  1 was testing; it took that one's place, the plan's answer found nothing
  waiting for it, and the fault was neither confirmed nor validated.)
- One validation at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .verdict import Diagnosis

PAUSE_BUDGET = 0.01          # share of wall time validation may pause the job...
PAUSE_BUDGET_WINDOW_S = 600  # ...over any window this long
BACKOFF_S = 30.0
BACKOFF_MAX_S = 600.0
# Longest a host's own slow episode lasted on this project's 2-core VMs (CI,
# bench_diagnosis: collective shifts of 20-40% for up to 17 s).
PERSIST_S = 20.0
# A job slowdown this large (the detector's after/before) is beyond what a
# busy shared host does (passive.py calls under 25% too small to name): a
# passive look that finds under 10% of it contradicts it.
DISAGREE_RATIO = 1.25
# A validation's pause, until one has been measured: a CPU machine's GEMMs
# and p2p rounds take 2-3 s (README, bench_diagnosis), a GPU's less.
EXPECTED_PAUSE_S = 3.0
# A recheck's: two devices' GEMMs, no links.
RECHECK_PAUSE_S = 1.0
# A verdict a plan tests waits this long at most for the plan's answer.
PLAN_HOLD_S = 10.0
# Verdicts on how the job runs now, not on a slowdown since a change point:
# the ranks compared with each other, and the calls' own bandwidth.
NOW_METHODS = ("cross-section", "bandwidth")


def _what(v: Diagnosis) -> tuple:
    return v.cause, tuple(sorted(v.ranks)), v.link


@dataclass
class Request:
    id: int
    index: int | None            # the slowdown's onset iteration, or the verdict's
    reason: str
    purpose: str = "diagnose"    # diagnose, or recheck (is a named fault still there?)
    ranks: tuple[int, ...] = ()  # the ranks the reason concerns (all are measured)


@dataclass
class _Pending:
    verdict: Diagnosis
    since_ns: int
    said: bool = False           # the deferral was reported
    plan: int | None = None      # the seq of the plan that tests it, until it answers


@dataclass
class ValidationPlanner:
    enabled: bool = True
    budget: float = PAUSE_BUDGET
    window_s: float = PAUSE_BUDGET_WINDOW_S
    pauses: list = field(default_factory=list)   # (start_ns, end_ns) of closed pause spans
    paused_total_s: float = 0.0
    validations: int = 0
    in_flight: Request | None = None
    pending: _Pending | None = None
    backoff_s: float = 0.0
    not_before_ns: int = 0
    slow_since_ns: int | None = None             # onset of the job slowdown in progress
    slow_ratio: float = 1.0                      # its size (after / before)
    named_at_ns: int | None = None               # when validation last named a cause
    recovered_ns: int | None = None              # when the job last recovered
    known: tuple | None = None                   # what it named: (cause, ranks, link)
    known_by: str = "validation"                 # or "the plan" (it ran as predicted)
    confirmed: int = 0                           # verdicts a plan confirmed (no pause)
    _next_id: int = 1
    _last_pause_s: float = EXPECTED_PAUSE_S      # all the pauses of the last validation
    _pausing_s: float = 0.0                      # the one in flight's, so far

    # -- inputs -------------------------------------------------------------------

    def observe(self, ev: dict) -> None:
        """Job-level slowdown/recovery events: is a slowdown in progress?"""
        if ev.get("scope") != "job":
            return
        if ev["kind"] == "slowdown" and self.slow_since_ns is None:
            onset = ev.get("onset_ns")
            self.slow_since_ns = int(onset if onset is not None else ev["time_ns"])
            self.slow_ratio = float(ev.get("ratio") or 1.0)
        elif ev["kind"] == "recovery":
            self.slow_since_ns, self.slow_ratio = None, 1.0
            if ev.get("time_ns") is not None:
                self.recovered_ns = int(ev["time_ns"])

    def pause(self, start_ns: int, end_ns: int) -> None:
        """A validation pause of the job, once over."""
        self.pauses.append((start_ns, end_ns))
        s = max(0, end_ns - start_ns) / 1e9
        self.paused_total_s += s
        self._pausing_s += s
        horizon = end_ns - int(2 * self.window_s * 1e9)
        self.pauses = [p for p in self.pauses if p[1] >= horizon]

    def consider(self, v: Diagnosis, now_ns: int, plan: int | None = None) -> list[dict]:
        """A passive verdict: a request or a deferral (`validation` event
        fields), or nothing. `plan`: the seq of a plan that moves work off
        the rank it names (held for the plan's answer: `plan_answer`)."""
        if not self.enabled or (v.details.get("below_min_ratio")
                                and self.slow_ratio < DISAGREE_RATIO):
            return []
        if self.slow_since_ns is None and not v.named:
            return []             # the slowdown is over and nothing was named
        if (not v.named and self.named_at_ns is not None and self.slow_since_ns is not None
                and self.named_at_ns >= self.slow_since_ns):
            return []             # validation has named this slowdown's cause already
        held = self.pending
        if held is not None and held.plan is not None and _what(held.verdict) == _what(v):
            return []             # the same verdict again: still held for its plan's answer
        if held is not None and held.verdict.named and not v.named:
            return []             # says less than the one waiting (whose request measures all)
        self.pending = _Pending(v, now_ns)
        if plan is not None and v.cause == "computation" and v.straggler is not None \
                and not (self.known == _what(v) and self._known_within(now_ns)):
            self.pending.plan, self.pending.said = plan, True
            return [{"phase": "deferred", "index": v.index,
                     "reason": f"plan {plan} moves work off rank {v.straggler}, a test of this "
                               "verdict: validated only if the job then runs nearer the even "
                               "split's speed than the plan's"}]
        return self.tick(now_ns)

    def held_for(self) -> int | None:
        """The seq of the plan whose answer the pending verdict waits for."""
        return self.pending.plan if self.pending is not None else None

    def plan_answer(self, seq: int, confirms: bool, why: str, now_ns: int) -> list[dict]:
        """The plan `seq` has been measured: a verdict it tests is confirmed
        (no measurement), or validated after all."""
        p = self.pending
        if p is None or p.plan != seq:
            return []
        p.plan = None
        if not confirms:
            p.said = False
            return self.tick(now_ns)
        self.pending = None
        self.confirmed += 1
        self.known, self.known_by, self.named_at_ns = _what(p.verdict), "the plan", now_ns
        self.backoff_s, self.not_before_ns = 0.0, 0
        return [{"phase": "skipped", "index": p.verdict.index, "confirmed_by": "plan",
                 "cause": p.verdict.cause, "ranks": sorted(p.verdict.ranks),
                 "reason": f"plan {seq} confirmed it: {why}; not measured"}]

    def tick(self, now_ns: int) -> list[dict]:
        """Ask for the pending validation once nothing holds it back."""
        p = self.pending
        if p is None or self.in_flight is not None:
            return []
        if p.plan is not None:
            if now_ns - p.since_ns < PLAN_HOLD_S * 1e9:
                return []                # the plan that tests it has not answered yet
            p.plan, p.said = None, False
        v = p.verdict
        if v.named and self.known == _what(v) and self._known_within(now_ns):
            self.pending = None
            return [{"phase": "skipped", "index": v.index,
                     "reason": f"{self.known_by} named this "
                               f"{(now_ns - self.named_at_ns) / 1e9:.0f} s ago: not measured "
                               "again"}]
        # Naming something else while a cause is known: perhaps that fault
        # seen otherwise, so held as a verdict naming nothing is. Not a link
        # the job has recovered from since: that fault is over.
        other = v.named and self._known_within(now_ns) and not self._link_over()
        if self.slow_since_ns is None and (not v.named or other):
            self.pending = None
            return []
        if (self.slow_since_ns is None and v.cause == "communication"
                and v.details.get("method") not in NOW_METHODS):
            # Its slowdown is over (judged at its recovery, or ended while it
            # waited): a link that recovered measures healthy. (A rebalance
            # hides a slow rank: a computation verdict is measured anyway.)
            self.pending = None
            return [{"phase": "skipped", "index": v.index,
                     "reason": "its slowdown is over, and a link that recovered measures "
                               "healthy: validated if it slows the job again"}]
        why = None
        lasted = ((now_ns - self.slow_since_ns) / 1e9 if self.slow_since_ns is not None
                  else 0.0)
        if not v.named and not v.details.get("suspected_cause"):
            if lasted < PERSIST_S:
                why = ("nothing named" + (" (every rank slowed alike: the host or the whole "
                                          "job)" if v.details.get("uniform") else "")
                       + f": validated if it lasts {PERSIST_S:.0f} s")
        elif other and (now_ns - max(p.since_ns, self.slow_since_ns)) / 1e9 < PERSIST_S:
            # From this verdict: the known fault's own slowdown may never
            # have recovered in the detector's eyes.
            ago = (now_ns - self.named_at_ns) / 1e9
            why = (f"{self.known_by} named {self._known_words()} {ago:.0f} s ago, which can "
                   f"look like this: validated if it lasts {PERSIST_S:.0f} s")
        if why is None and v.straggler is None and now_ns < self.not_before_ns:
            why = (f"the last validation named nothing: backing off "
                   f"{self.backoff_s:.0f} s")
        if why is None:
            used = self.paused_in_window(now_ns)
            allowed = self.budget * self.window_s
            if used + self._last_pause_s > allowed:
                why = (f"pause budget: {used:.1f} s of {allowed:.1f} s used in the last "
                       f"{self.window_s / 60:.0f} min")
        if why is not None:
            if p.said:
                return []
            p.said = True
            return [{"phase": "deferred", "index": v.index, "reason": why}]
        self.pending = None
        suspected = v.details.get("suspected_cause")
        req = Request(self._next_id, v.index, f"{v.evidence} verdict: {v.cause}"
                      + (f" (rank {v.straggler})" if v.straggler is not None else "")
                      + (f", suspects {suspected}" if suspected else ""),
                      ranks=v.ranks)
        self._next_id += 1
        self.in_flight = req
        self._pausing_s = 0.0
        self.validations += 1
        # The devices the verdict named slow: measured slow in the pause,
        # they need no second one (validator.CONFIRM_SKIP_NAMED_RATIO).
        suspects = sorted(v.ranks) if v.cause == "computation" else []
        return [{"phase": "request", "id": req.id, "index": req.index, "reason": req.reason,
                 "purpose": req.purpose, "suspects": suspects}]

    def recheck(self, rank: int, now_ns: int) -> list[dict]:
        """Is a named fault still there? (the policy asks, for the rank whose
        plan is in force): its device and a witness's, no links, a short
        pause; within the budget, or not at all (the policy asks again)."""
        if not self.enabled or self.in_flight is not None:
            return []
        used = self.paused_in_window(now_ns)
        if used + RECHECK_PAUSE_S > self.budget * self.window_s:
            return [{"phase": "deferred", "index": None, "purpose": "recheck",
                     "reason": f"recheck of rank {rank}: pause budget used ({used:.1f} s in "
                               f"the last {self.window_s / 60:.0f} min)"}]
        req = Request(self._next_id, None, f"is rank {rank}'s fault gone?", "recheck", (rank,))
        self._next_id += 1
        self.in_flight = req
        self.validations += 1
        self._pausing_s = 0.0
        return [{"phase": "request", "id": req.id, "index": None, "reason": req.reason,
                 "purpose": "recheck", "devices": [rank]}]

    def done(self, request_id: int, verdict: Diagnosis, now_ns: int) -> None:
        """The validator answered. (One validation runs at a time, so any
        answer ends the one in flight: a replay under changed rules feeds the
        recorded answers, whose ids may not be the requests it made.)"""
        self.in_flight = None
        self._last_pause_s = max(self._pausing_s, 0.5)
        self.known = _what(verdict) if verdict.named else None
        self.known_by = "validation"
        if verdict.named:
            self.backoff_s, self.not_before_ns = 0.0, 0
            self.named_at_ns = now_ns
        else:
            self.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_S, 2 * self.backoff_s))
            self.not_before_ns = now_ns + int(self.backoff_s * 1e9)

    # -- state ----------------------------------------------------------------------

    def _known_within(self, now_ns: int) -> bool:
        """Validation (or a plan) named a cause within the budget's window."""
        return (self.known is not None and self.named_at_ns is not None
                and now_ns - self.named_at_ns < self.window_s * 1e9)

    def _link_over(self) -> bool:
        """A link was named, and the job recovered since (a link that
        recovered measures healthy): a verdict now is not that fault seen
        otherwise. (A rank's slowness a plan hides recovers too: not over.)"""
        return (self.known is not None and self.known[0] == "communication"
                and self.recovered_ns is not None and self.named_at_ns is not None
                and self.recovered_ns > self.named_at_ns)

    def _known_words(self) -> str:
        cause, ranks, link = self.known
        return f"{cause} ({link or ', '.join(f'rank {r}' for r in ranks)})"

    def paused_in_window(self, now_ns: int) -> float:
        lo = now_ns - int(self.window_s * 1e9)
        return sum(max(0, e - max(s, lo)) for s, e in self.pauses if e > lo) / 1e9
