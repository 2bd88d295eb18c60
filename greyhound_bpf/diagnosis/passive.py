"""Passive diagnosis: which rank, and computation or communication.

Fed the event stream like every other consumer. When the job slows down it
compares each rank's compute and blocked (communication) time per iteration
after the onset with before it:

- **computation straggler**: one rank's compute grew by at least a quarter
  of the slowdown, or by 15% of it and 3x any other rank's growth (and by
  half its own value) while every other rank's
  compute stayed flat and its blocked time grew (by a quarter of it), the
  others' median by at least half of it and by more than the straggler's
  (they wait for it in the collective; DESIGN.md: with synchronous gloo
  collectives the slow rank waits least), its growth at least EXPLAINS of
  their longer wait (a slow link makes them wait far longer than any one
  rank's compute grew);
- **communication**: blocked time grew by at least half the slowdown (and by
  half its own value, the median rank's doubling: `COMM_RATIO`) on every
  rank while no rank's compute grew by more than a quarter of it; the
  communicator named is the smallest one of the communicator map
  (greyhound_bpf.topology) that holds every such rank, once the slowdown
  has lasted UNIFORM_LASTS_S (a busy host does the same for seconds; until
  then `unknown` with `details.suspected_cause`, which validation measures). When
  only the two ends of a pipeline (p2p) edge wait longer, that edge is the
  link;
- a cause is named only when it holds over the first `window` iterations
  after the onset and over the latest ones when the verdict is made
  (seconds later): a rank descheduled for a moment on a busy host looks like
  a straggler at first, a fault lasts. A straggler over the latest ones
  that the first did not show (a CPU quota shows in every rank's
  collectives at first) is named if the next `window` iterations show it
  again;
- otherwise ``unknown``, with the numbers: never a guess. A slowdown that
  grows in steps is judged from its first onset, then from each further
  step's onset until one names a cause: a fault that begins during a busy
  host's own slow episode is compared with that episode's level;
- a slowdown that began near Greyhound's own activity (engine.activity:
  validation workers starting or measuring on this machine, an attach, a
  plan being applied) may be ours: that load slows some rank of a busy host
  down for real. Its verdict waits until that activity is over and is made
  from the iterations after it: a slowdown that recovers first was ours and
  gets none; one that outlasts our activity is the job's.

The verdict is a ``diagnosis`` event with ``evidence: passive``. Medians
over `window` iterations on each side of the onset; a verdict needs
`min_after` iterations after it on every rank and a slowdown that has lasted
`min_lasted_s` (a blip of a busy host is not a fault), or BUSY_BEFORE_NS
while it lasts (so that validation activity that begins just after the
onset is seen), and it is ``unknown``
when over these windows the job is less than `min_ratio` slower.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ..engine.activity import ActivityLog
from ..events import is_speed_sample
from .planner import PERSIST_S
from .verdict import Diagnosis

# A slowdown may be our own when it begins this close to validation activity.
BUSY_BEFORE_NS, BUSY_AFTER_NS = 2_000_000_000, 2_000_000_000
# ...and the part that grew did so by >= this x its own value before (the
# straggler's compute, or every rank's blocked time): a busy host shifts
# both by 20-40% for seconds at a time; the faults worth naming cost more.
REL_GROW = 0.5
# A named verdict needs the job >= 25% slower over the windows: a healthy
# busy host moves a rank's few-ms compute by 4 ms (15-20% of an iteration).
NAME_RATIO = 1.25
GROW = 0.5        # the others' wait grew by >= this x the slowdown
# The straggler's compute grew by >= this x the slowdown: a rank throttled
# by a CPU quota is throttled in its own collectives too (gloo's threads
# share its cgroup), so part of its lost time shows there. A 4-rank job with
# rank 2 at half its CPU: compute +13-21 ms of a 33-42 ms slowdown (0.32-0.51).
STRAGGLER_SHARE = 0.25
# ...or by >= OUTLIER_SHARE x the slowdown when it stands out: >= OUTLIER x
# every other rank's growth. A third of rank 2's CPU in CI: +13.4 ms of a
# 53.8 ms slowdown (0.249, just under the share) against +0.7-3.3 ms.
OUTLIER_SHARE, OUTLIER = 0.15, 3.0
FLAT = 0.25       # "did not grow": by less than this x the slowdown
# The straggler's compute growth accounts for >= this x the others' longer
# wait: they wait for it, so its lost time is theirs (a CPU quota hides part
# of it in the straggler's own collectives: 0.24-0.38 in the corpus and in CI,
# 0.64-0.92 for other faults). A slow link makes every rank wait, one far
# longer: CI's three-node test (a 200 Mbit tbf on node n1) read rank 2's
# compute +4.4 ms against the others' +62.1 ms (0.07) and was named rank 2.
EXPLAINS = 0.15
# A whole communicator is named slow only when its collectives take >= this
# x as long as before (median rank). On a CPU host gloo's collectives are
# CPU work, and ranks descheduled in turn on a busy host make every rank
# wait longer: a healthy 4-rank job on a 2-core VM saw 1.6-1.73x for seconds
# (CI, 2026-11-22), a 400mbit tbf on one rank's link 2.25-2.73x.
COMM_RATIO = 2.0
# ...and only once its slowdown has lasted this long (and holds over the
# latest iterations then): the same healthy CI job later read x5.2 for 8 s
# (2026-11-28), its compute flat. A slow link lasts; a busy host's episodes
# pass. The validation planner's PERSIST_S, for the same reason.
UNIFORM_LASTS_S = PERSIST_S
HOLD_LOOK_NS = 500_000_000     # ...looked at again this often meanwhile
# Looks at an undecided slowdown per job iteration, at most (each looks at
# every rank): every sample up to 15 ranks, 8 times an iteration above.
TRIES_PER_ITERATION = 8


@dataclass
class _Series:
    rows: deque = field(default_factory=lambda: deque(maxlen=256))   # (start_ns, dur, compute, comm)


def _medians(before: list, after: list) -> dict:
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"compute_before_ms": med(before, 2), "compute_after_ms": med(after, 2),
            "comm_before_ms": med(before, 3), "comm_after_ms": med(after, 3),
            "iter_before_ms": med(before, 1), "iter_after_ms": med(after, 1)}


class PassiveDiagnoser:
    def __init__(self, window: int = 16, min_after: int = 10, topology=None,
                 min_lasted_s: float = 1.0, min_ratio: float = 1.10,
                 activity: ActivityLog | None = None):
        self.window, self.min_after = window, min_after
        self.min_lasted_ns, self.min_ratio = int(min_lasted_s * 1e9), min_ratio
        self.topology = topology           # engine.topology.Topology, optional
        # Greyhound's own activity (shared with the pipeline that marks
        # the iterations it disturbed).
        self.activity = activity if activity is not None else ActivityLog()
        self.ranks: dict[int, _Series] = {}
        self.onset_ns: int | None = None
        self.slowdown: dict | None = None
        self.until_ns: int | None = None       # the slow level's end, once recovered
        self.steps: list[dict] = []            # further job slowdown steps, not yet judged
        self.second: tuple | None = None       # (latest verdict, from_ns): to be held again
        self.hold_ns: int | None = None        # a uniform verdict waits until then
        self.done = False
        self._samples = 0

    def observe(self, ev: dict) -> list[Diagnosis]:
        """Returns the verdicts (`diagnosis` events) to emit."""
        kind = ev["kind"]
        if is_speed_sample(ev):
            rank = int(ev["rank"])
            s = self.ranks.setdefault(rank, _Series())
            s.rows.append((ev["start_ns"], ev["dur_ns"] / 1e6, ev["compute_ns"] / 1e6,
                           ev["comm_ns"] / 1e6))
            if self.slowdown is not None and not self.done:
                # A try looks at every rank: with thousands of ranks, at most
                # TRIES_PER_ITERATION times per job iteration (every sample
                # up to 15 ranks).
                self._samples += 1
                if self._samples >= len(self.ranks) // TRIES_PER_ITERATION:
                    self._samples = 0
                    return self._try()
            return []
        if kind == "slowdown" and ev.get("scope") == "job":
            if self.slowdown is not None and not self.done and self.until_ns is None:
                # A further step of an undecided slowdown: judged from the
                # same onset (a ramp), and from its own if that says unknown
                # (a fault that began during a host's noise episode).
                self.steps.append(ev)
                return self._try()
            self.slowdown, self.onset_ns, self.done = ev, int(ev["onset_ns"]), False
            self.until_ns, self.steps, self.second = None, [], None
            self.hold_ns = None
            return self._try()
        if kind == "applied" and self.slowdown is not None and not self.done:
            # A plan changes each rank's work: later iterations no longer
            # compare with the ones before the onset. Judge what came before.
            self.until_ns = int(ev["time_ns"])
            out = self._try()
            if not out:
                self.done = True
                out = [Diagnosis("passive", "unknown",
                                 "a mitigation plan changed the ranks' work before the "
                                 "evidence was enough; validation measures it",
                                 self.slowdown["index"], details={"plan_seq": ev.get("seq")})]
            return out
        if kind == "recovery" and ev.get("scope") == "job":
            out = []
            if self.slowdown is not None and not self.done:
                # Over before a verdict (a blip, or a fix such as a rebalance):
                # judged on its slow iterations if it lasted long enough.
                end = ev.get("onset_ns") or ev.get("time_ns")
                self.until_ns = int(end) if end else max(
                    (s.rows[-1][0] for s in self.ranks.values() if s.rows), default=0)
                out = self._try()
            self.slowdown, self.onset_ns, self.until_ns, self.steps = None, None, None, []
            self.second, self.hold_ns = None, None
            return out
        return []

    def _split(self, s: _Series, from_ns: int):
        """The `window` iterations before the onset, and every one since
        `from_ns` (until the slow level's end, once known)."""
        before = [r for r in s.rows if r[0] < self.onset_ns][-self.window:]
        after = [r for r in s.rows if r[0] >= from_ns
                 and (self.until_ns is None or r[0] < self.until_ns)]
        return before, after

    def _after_busy(self) -> int | None:
        """Where the `after` iterations may start: the onset, or the end (plus
        a margin) of any activity of ours since shortly before it, which may
        have slowed the job itself; None while some still goes on."""
        from_ns = self.onset_ns
        for span in self.activity.near(self.onset_ns, BUSY_BEFORE_NS):
            if span.what == "plan":
                continue              # judged on its own (`applied`)
            if span.end_ns is None:
                return None
            from_ns = max(from_ns, span.end_ns + BUSY_AFTER_NS)
        return from_ns

    def _try(self) -> list[Diagnosis]:
        out = self._judge()
        # An unknown verdict on the first step defers to the next step's own
        # onset (its before-window is the first step's level), if it began
        # before the evidence ends: each step gets a verdict until one names a
        # cause or none is left.
        while out and not out[0].named and not out[0].details.get("suspected_cause") and self.steps:
            step = self.steps.pop(0)
            if self.until_ns is not None and int(step["onset_ns"]) >= self.until_ns:
                continue
            earlier = out
            self.slowdown, self.onset_ns, self.done = step, int(step["onset_ns"]), False
            self.second, self.hold_ns = None, None
            out = self._judge()
            if not out and self.until_ns is not None:
                out, self.done = earlier, True      # too little evidence left: it stands
        return out

    def _judge(self) -> list[Diagnosis]:
        from_ns = self._after_busy()
        if from_ns is None:
            return []
        newest = max((s.rows[-1][0] for s in self.ranks.values() if s.rows), default=0)
        if self.until_ns is None and self.hold_ns is not None and newest < self.hold_ns:
            return []                   # a uniform verdict waits to see it last
        if self.until_ns is None and newest < self.onset_ns + BUSY_BEFORE_NS:
            # Validation activity that begins just after the onset (another
            # `validate` starting up) may be the cause: it must be seen first.
            return []
        per, late = {}, {}
        for rank, s in self.ranks.items():
            before, after = self._split(s, from_ns)
            if len(before) < self.min_after and len(s.rows) == s.rows.maxlen:
                # A drift found long after it began: the iterations before
                # its onset are no longer kept, and never will be again.
                self.done = True
                return [Diagnosis("passive", "unknown",
                                  "the slowdown began before the oldest iteration kept "
                                  f"({s.rows.maxlen} per rank): nothing to compare it with; "
                                  "validation measures it", self.slowdown["index"],
                                  details={"onset_ns": self.onset_ns,
                                           "oldest_kept_ns": s.rows[0][0]})]
            last = s.rows[-1][0] if self.until_ns is None else self.until_ns
            if (len(before) < self.min_after or len(after) < self.min_after
                    or last < from_ns + self.min_lasted_ns):
                return []
            per[rank] = _medians(before, after[:self.window])
            late[rank] = _medians(before, after[-self.window:])
        if len(per) < 2:
            return []
        if self.second is not None:
            return self._held_again(late, from_ns, newest)
        self.done = True
        v = self._classify(per, from_ns)
        if not v.named:
            return [v]
        # A fault lasts; a busy host's episodes pass. The verdict must hold
        # over the latest iterations too (seconds later: the verdict waits
        # BUSY_BEFORE_NS), or it is not named.
        again = self._classify(late, from_ns)
        if (again.cause, again.ranks, again.link) == (v.cause, v.ranks, v.link):
            if v.cause == "communication" and v.link is None:
                return self._lasted(v, newest)
            return [v]
        if again.cause == "computation" and self.until_ns is None:
            # A straggler now, not at the onset: a fault may settle (a CPU
            # quota's cost shows in every rank's collectives first, in the
            # straggler's compute once its bursts settle). It is named if
            # it holds over the next `window` iterations too. (Not the other
            # way: collectives that grew everywhere after a straggler passed
            # are what a busy host does.)
            self.second, self.done = (again, newest), False
            return []
        details = {**v.details, "latest": {
            str(r): {k: round(x, 3) for k, x in p.items() if "after" in k}
            for r, p in sorted(late.items())}}
        return [v.but(cause="unknown", ranks=(), communicator=None, link=None, details=details,
                      reason=f"at first {v.reason}, but over the latest {self.window} "
                             f"iterations: {again.reason}; a passing episode is no fault "
                             "(validation measures it)")]

    def _lasted(self, v: Diagnosis, newest: int) -> list[Diagnosis]:
        """Every rank waits longer in its collectives, at first and lately:
        named once the slowdown has lasted UNIFORM_LASTS_S since its onset,
        and over before that, no fault. Meanwhile undecided: said once as
        `unknown` with `details.suspected_cause` (the validation planner measures
        the links now, as for a named verdict), then looked at again every
        HOLD_LOOK_NS (a CPU quota's straggler shows this way first)."""
        lasts_ns = int(UNIFORM_LASTS_S * 1e9)
        end = self.until_ns if self.until_ns is not None else newest
        if end - self.onset_ns >= lasts_ns:
            return [v]
        if self.until_ns is None:
            first = self.hold_ns is None
            self.hold_ns = min(self.onset_ns + lasts_ns, newest + HOLD_LOOK_NS)
            self.done = False
            if not first:
                return []
            return [v.but(cause="unknown", ranks=(), communicator=None,
                          details={**v.details, "suspected_cause": "communication"},
                          reason=f"{v.reason}: a slow link, or a busy host's episode; named "
                                 f"if it lasts {UNIFORM_LASTS_S:.0f} s (validation measures "
                                 "the links now)")]
        return [v.but(cause="unknown", ranks=(), communicator=None,
                      reason=f"{v.reason}, but for {(end - self.onset_ns) / 1e9:.1f} s only: "
                             "a busy host's episodes look so, a slow link lasts "
                             f"{UNIFORM_LASTS_S:.0f} s and more")]

    def _held_again(self, late: dict, from_ns: int, newest: int) -> list[Diagnosis]:
        """The latest verdict named a cause the first did not: it stands if
        the `window` iterations after it name it again."""
        first, at = self.second
        if self.until_ns is None and any(sum(r[0] > at for r in s.rows) < self.window
                                         for s in self.ranks.values()):
            return []
        self.second, self.done = None, True
        again = self._classify(late, from_ns)
        if (again.cause, again.ranks, again.link) == (first.cause, first.ranks, first.link):
            return [again.but(reason=f"{again.reason} (so over the latest {self.window} "
                                     "iterations twice, seconds apart; not at the onset)")]
        return [again.but(cause="unknown", ranks=(), communicator=None, link=None,
                          reason=f"over the latest iterations {first.reason}, but over the "
                                 f"next {self.window}: {again.reason}; a passing episode is "
                                 "no fault (validation measures it)")]

    def _classify(self, per: dict, from_ns: int) -> Diagnosis:
        delta = statistics.median(p["iter_after_ms"] - p["iter_before_ms"] for p in per.values())
        d_comp = {r: p["compute_after_ms"] - p["compute_before_ms"] for r, p in per.items()}
        d_comm = {r: p["comm_after_ms"] - p["comm_before_ms"] for r, p in per.items()}
        details = {"slowdown_ms": round(delta, 3),
                   "ranks": {str(r): {k: round(v, 3) for k, v in p.items()}
                             for r, p in sorted(per.items())}}
        if from_ns != self.onset_ns:
            details["after_validation_from_ns"] = from_ns

        def verdict(cause, reason, ranks=(), communicator=None, link=None):
            return Diagnosis("passive", cause, reason, self.slowdown["index"], tuple(ranks),
                             communicator, link, details)
        before_ms = statistics.median(p["iter_before_ms"] for p in per.values())
        if delta <= 0 or delta < (self.min_ratio - 1) * before_ms:
            details["below_min_ratio"] = True
            return verdict("unknown", f"over these windows the job is only {delta:+.1f} ms per "
                           f"iteration slower (under {100 * (self.min_ratio - 1):.0f}%)")
        def stands_out(r):
            rest = max((d for q, d in d_comp.items() if q != r), default=0.0)
            return d_comp[r] >= OUTLIER_SHARE * delta and d_comp[r] >= OUTLIER * max(rest, 1e-3)
        grew = [r for r, d in d_comp.items() if (d >= STRAGGLER_SHARE * delta or stands_out(r))
                and d >= REL_GROW * per[r]["compute_before_ms"]]
        # No one rank stands out: the host, the whole job or a whole
        # communicator (validation.planner validates those only if they last).
        details["uniform"] = len(grew) != 1
        if delta < (NAME_RATIO - 1) * before_ms:
            return verdict("unknown", f"{delta:.1f} ms per iteration ({100 * delta / before_ms:.0f}%)"
                           " is too small to name from timing alone on a shared host (under "
                           f"{100 * (NAME_RATIO - 1):.0f}%); validation measures it")
        if len(grew) == 1:
            s = grew[0]
            others = [r for r in per if r != s]
            # ...the others wait for it, and longer than it waits for them:
            # their median (a quota's bursts make each rank's median over a
            # window noisy; one of them may read under the straggler's),
            # while every one of them waits longer than before.
            waited = statistics.median(d_comm[r] for r in others)
            if (waited >= GROW * delta and waited > d_comm[s]
                    and d_comp[s] >= EXPLAINS * waited
                    and all(d_comm[r] >= FLAT * delta and d_comp[r] < FLAT * delta
                            for r in others)):
                return verdict("computation", f"rank {s}'s compute grew {d_comp[s]:.1f} ms per "
                               f"iteration while the others waited {waited:.1f} ms longer in "
                               "collectives", [s])
        waited = sorted(r for r, d in d_comm.items() if d >= GROW * delta)
        flat = all(d < FLAT * delta for d in d_comp.values())
        topo = self.topology.fields() if self.topology is not None else None
        if flat and waited == sorted(per) and all(
                d_comm[r] >= REL_GROW * per[r]["comm_before_ms"] for r in per):
            ratio = statistics.median(p["comm_after_ms"] / max(p["comm_before_ms"], 1e-3)
                                      for p in per.values())
            if ratio < COMM_RATIO:
                return verdict("unknown", f"every rank waits x{ratio:.2f} as long in collectives:"
                               f" under x{COMM_RATIO:.0f}, which a busy host's scheduling alone "
                               "can cause; validation measures the links")
            comm = self.topology.communicator_of(waited) if topo else None
            where = f" of {comm['name']}" if comm else ""
            return verdict("communication", f"time in collectives{where} grew "
                           f"{statistics.median(d_comm.values()):.1f} ms per iteration on every "
                           "rank; compute stayed flat", waited, comm["name"] if comm else None)
        if flat and topo and len(waited) == 2 and waited in topo["p2p_edges"]:
            a, b = waited
            details["uniform"] = False
            return verdict("communication", f"only ranks {a} and {b}, the ends of a pipeline "
                           f"edge, wait longer ({d_comm[a]:.1f} and {d_comm[b]:.1f} ms per "
                           "iteration); compute stayed flat", waited, link=f"{a}<->{b}")
        return verdict("unknown", "neither one rank's compute nor every rank's communication "
                       "accounts for the slowdown")
