"""The cross-section call by call: who the others wait for at each
collective, for a job too slow and too sparse in collectives to count its
iterations in time. Pure: fed call records, as the bandwidth floor is.

The cross-section (crosssection.py) compares the ranks' iterations, and a
rank has iterations only once its call pattern has locked (16 calls at
least, engine/iterations.py) and a window of them has passed. A job slow
and sparse in collectives has neither within 15 s of an attach: a vision
transformer with activation checkpointing (examples/vit_checkpoint.py)
makes 3 all-reduces an iteration at 1-4 s each, and its straggler was
named 16-43 s after the attach or the onset. Its collectives still say who
is slow, one at a time: each waits for the last rank to arrive, and the
time a rank spends between its collectives is its compute. Over the
latest collectives of the lowest rank (those spanning SPAN_S, MIN_CALLS at
least), each matched with every other rank's same one (crosssection.align:
only collectives that hold every rank at one instant, so a mesh's or a
pipeline's subgroups' do not count), and the one where the suspect's excess
was largest left out whole (one checkpoint, one stall of the host, is not
a fault), rank s is a computation straggler when

- it arrived last at >= LAST_SHARE of those that follow compute (the early
  look's bar; one issued at once after another has no one to wait for);
- its time between them exceeds the others' (their upper median) by >=
  EXCESS of the job's time over them and by >= REL_EXCESS of theirs, while
  the others spend >= WAIT_SHARE of its excess longer inside them: the
  medians' test of the cross-section, over calls instead of iterations;
- and on two looks in a row, the evidence from the first one's window on
  spanning SPAN_S (WINDOW_S + MIN_S), as the cross-section's verdict on a
  slow job needs; or on one look over MIN_STRONG collectives at least where
  the evidence is strong (last at every one that follows compute, its
  excess STRONG_EXCESS of the job's time and STRONG_REL of the others').

Only where the iterations cannot be counted in time: once the lowest
rank's calls span SPAN_S (its pace known), and only while it made fewer
than MIN_ARRIVALS collectives over SPAN_S (what the early look needs over
that span), or while some rank's iterations are not counted (`locked`,
`iteration`): its calls not locked into iterations, or its iterations
covering under COUNTED of the look's span. A job dense in collectives
whose steps come at an irregular rhythm locks late
(examples/adaptive_averaging.py, a parameter average every 8-13 steps:
some ranks 20-30 s after an attach), or locks on one length of its
cycle and counts only the cycles of that length; until every rank's
iterations are counted, the iterations' looks, which compare every
rank's, cannot judge it (a job whose KEEP latest collectives span less
than SPAN_S is still left to them). Not under an uneven split of the
work (a plan in force), nor over calls Greyhound's own activity
overlapped. (Across nodes an agent shares the calls of sparse ranks only;
a dense job's are judged by each node's own analysis.) Only blocking
collectives count (gloo's): an NCCL call only enqueues, and its host-side
time says nothing of who arrived last.
"""
from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from ..engine.activity import ActivityLog
from ..probe.catalog import Catalog
from .crosssection import (EXCESS, LAST_SHARE, MIN_ARRIVALS, MIN_S, REL_EXCESS, STRONG_REL,
                           WAIT_SHARE, WINDOW_S, Streak, align)
from .verdict import Diagnosis

# A look's fewest collectives: two iterations' worth of the sparse job
# (3 all-reduces each), where the early look asks for 24 at a job that
# makes that many in two iterations. The last-arrival share alone would be
# weak over so few (a healthy rank of three last at 4 of the 5 left by
# chance: 4.5%), so the excess and wait tests of the cross-section go with it.
MIN_CALLS = 6
# Strong evidence needs fewer, and one look: two updates of a job that
# makes two collectives each (fairseq's legacy trainer, 6-7 s an update
# with a slow rank: six collectives and a second look took 35 s). Set on
# the tune split (its slow sparse jobs: the ViT, gossip, and fairseq's two
# fault recordings, moved there for it): over 234 looks of healthy
# stretches the excess reached 0.22 of the job's time (relative 0.37), and
# one look only had one rank last at every collective that follows
# compute; the straggler's passing looks read 0.33-0.78. The bar is about
# twice the healthy maximum; STRONG_REL is the cross-section's.
MIN_STRONG = 4
STRONG_EXCESS = 0.5
# A collective follows compute when the ranks' median gap before it is a
# tenth of the window's largest at least (fairseq's gradient all-reduce:
# 2-35 ms after its statistics' 1.3-1.5 s).
FOLLOWS = 0.1
KEEP = 96             # collectives kept per rank
# A look's span: what the cross-section's verdict on a slow job needs its
# evidence to span (a busy host's burst on one rank, seconds long, is
# diluted in it, where a fault's excess is not).
SPAN_S = WINDOW_S + MIN_S
# A locked rank's iterations count its time when they cover this share of
# the look's span at least. Set on bench_tries' recordings of the
# drift-triggered averaging (seed 569): locked 1.2 s after the attach on a
# 13-call cycle, its ranks' iterations covered about 60% of their time
# (only the cycles of that length), too few for the iterations' looks; a
# pattern that fits covers all of it. Over the corpus (both splits) this
# bar changed two verdicts, both sooner and right.
COUNTED = 0.7
# Looks in a row without a straggler before a named one may be named again
# (the cross-section's `looks`).
QUIET_LOOKS = 3


class CallCross:
    def __init__(self, catalog: Catalog, activity: ActivityLog | None = None):
        self._coll = np.zeros(max(len(catalog.functions), 1) + 1, dtype=bool)
        for fn in catalog.functions:
            if fn.kind == "collective" and fn.blocking:
                self._coll[fn.fid] = True
        self.activity = activity if activity is not None else ActivityLog()
        self.calls: dict[int, deque] = {}    # rank -> (gap_ns or None, start_ns, end_ns)
        self._ends: dict[int, int] = {}      # rank -> the latest end of its collectives
        self.streak = Streak(QUIET_LOOKS)
        self.last: dict | None = None        # the numbers of the last look
        self._uneven = False
        self._looked: int | None = None      # the end of the last look's window
        self._share = False                  # keep what `shared` gives (an agent asks)
        self._shared: dict[int, list[tuple]] = {}
        self._locked: dict | None = None     # rank -> locked; None: never told (a controller)
        self._its: dict[int | None, deque] = {}   # rank -> its latest iterations' (start, end)

    def work(self, microbatches: dict[int, int | None] | None) -> None:
        """An uneven split of the work (a plan in force) stops the looks: a
        rank given more work is no straggler, and calls carry no share."""
        m = {n for n in (microbatches or {}).values() if isinstance(n, int) and n > 0}
        uneven = len(m) > 1
        if uneven != self._uneven:
            self._uneven, self.streak.looks = uneven, []

    def locked(self, ranks: dict[int | None, bool]) -> None:
        """Per rank, whether its calls have locked into iterations (the
        analysis says, before each batch of calls): until every rank's
        iterations are counted, a job dense in collectives is looked at
        call by call too. A CallCross never told (the controller's, which
        is sent iterations) takes them as counted."""
        self._locked = dict(ranks)

    def iteration(self, rank: int | None, start_ns: int, end_ns: int) -> None:
        """One of a rank's iterations, as the engine found it."""
        q = self._its.setdefault(rank, deque())
        q.append((start_ns, end_ns))
        while q and q[0][1] < end_ns - SPAN_S * 1e9:
            q.popleft()

    def _counted(self, now_ns: int) -> bool:
        """Every rank locked, its iterations covering COUNTED of the
        SPAN_S before now_ns."""
        if self._locked is None:
            return True
        lo = now_ns - SPAN_S * 1e9
        return all(ok and sum(max(0, min(e, now_ns) - max(s, lo))
                              for s, e in self._its.get(r, ())) >= COUNTED * SPAN_S * 1e9
                   for r, ok in self._locked.items())

    def feed(self, recs: np.ndarray, rank_of: dict[int, int | None]) -> list[Diagnosis]:
        if len(recs) == 0:
            return []
        fn = np.minimum(recs["fn"].astype(np.int64), len(self._coll) - 1)
        sel = recs[self._coll[fn] & (recs["dur_ns"] > 0)]
        if len(sel) == 0:
            return []
        fresh = False
        for pid in np.unique(sel["pid"]).tolist():
            rank = rank_of.get(pid)
            if rank is None:
                continue
            mine = sel[sel["pid"] == pid]
            mine = mine[np.argsort(mine["start_ns"], kind="stable")]
            start = mine["start_ns"].astype(np.int64)
            end = start + mine["dur_ns"].astype(np.int64)
            prev = self._ends.get(rank)
            # Each gap from the latest end before it (two of a rank's
            # collectives at once, gloo's pool of two threads: none).
            before = np.maximum.accumulate(np.concatenate(([prev or 0], end)))[:-1]
            k = max(0, len(start) - KEEP)               # (only the latest are kept)
            gaps = np.maximum(start[k:] - before[k:], 0).tolist()
            if prev is None and k == 0:
                gaps[0] = None
            self._add(rank, list(zip(gaps, start[k:].tolist(), end[k:].tolist())), int(end.max()))
            fresh = True
        return self._look() if fresh else []

    def take(self, by_rank: dict[int, list]) -> list[Diagnosis]:
        """Ranks' collectives as another analysis found them (a node's agent
        sends the job's controller what `shared` gave it): per rank, (gap_ns
        or None, start_ns, end_ns) each, in order; then one look, as `feed`."""
        fresh = False
        for rank, items in by_rank.items():
            items = [(None if g is None else int(g), int(s), int(e)) for g, s, e in items]
            if items:
                self._add(rank, items, max(e for _, _, e in items))
                fresh = True
        return self._look() if fresh else []

    def shared(self) -> dict[int, list[tuple]]:
        """Per rank, the collectives fed since the last call, of the ranks
        sparse enough for the look (fewer than twice MIN_ARRIVALS over
        SPAN_S): what a node's agent sends the job's controller, which is
        sent iterations, not calls. Kept from the first call on. One that
        Greyhound's own activity overlapped (the controller does not know of
        the attach's) goes with its gap unknown: no look counts it."""
        self._share = True
        out, self._shared = self._shared, {}
        return {r: [(None if g is None or self.activity.disturbing(s - g, e) else g, s, e)
                    for g, s, e in v] for r, v in out.items()}

    def _add(self, rank: int, items: list[tuple], end: int) -> None:
        """A rank's collectives, in order (`end`: the latest of their ends)."""
        self._ends[rank] = max(self._ends.get(rank, 0), end)
        q = self.calls.get(rank)
        if q is None:
            q = self.calls[rank] = deque(maxlen=KEEP)
        q.extend(items)
        if self._share and sum(x[1] >= q[-1][2] - SPAN_S * 1e9 for x in q) < 2 * MIN_ARRIVALS:
            self._shared.setdefault(rank, []).extend(items)

    def _window(self, lead: int) -> list[dict[int, int]] | None:
        """The lead rank's latest matched collectives that every rank's
        records have reached, spanning SPAN_S and MIN_CALLS at least; None
        where the job is not one to look at (module docstring)."""
        q = self.calls[lead]
        # Those it began before every rank's records end: a collective's
        # calls end together, give or take microseconds, and one whose
        # other calls are not in yet has no group (align).
        horizon = min(x[-1][2] for x in self.calls.values())
        mine = [x for x in q if x[1] <= horizon]
        if not mine:
            return None
        end = mine[-1][2]
        if end - mine[0][1] < SPAN_S * 1e9 or (
                sum(x[1] >= end - SPAN_S * 1e9 for x in mine) >= MIN_ARRIVALS
                and self._counted(end)):
            return None             # its pace unknown yet, or the iterations' looks will do
        idx = {r: list(x) for r, x in self.calls.items()}
        idx[lead] = mine
        calls = {r: [(x[1], x[2]) for x in v] for r, v in idx.items()}
        groups = align(calls, lead)
        # Whole: every rank's gap known, none of it in our own activity.
        whole = [g for g in groups if all(idx[r][j][0] is not None for r, j in g.items())
                 and not any(self.activity.disturbing(idx[r][j][1] - idx[r][j][0], idx[r][j][2])
                             for r, j in g.items())]
        starts = [idx[lead][g[lead]][1] for g in whole]
        k = sum(t >= end - SPAN_S * 1e9 for t in starts)
        take = whole[-max(k, MIN_CALLS):]
        if len(take) < MIN_STRONG:
            return None
        return [{r: idx[r][j] for r, j in g.items()} for g in take]

    def _test(self, win: list[dict]) -> tuple[bool, dict]:
        """Whether the window names its suspect (the numbers with it): over
        MIN_CALLS, or over fewer where the evidence is strong."""
        ranks = sorted(win[0])
        gap = {r: [g[r][0] / 1e6 for g in win] for r in ranks}
        comp = {r: sum(v) for r, v in gap.items()}
        s = max(comp, key=comp.get)
        others = [r for r in ranks if r != s]
        each = [gap[s][i] - statistics.median_high(gap[r][i] for r in others)
                for i in range(len(win))]
        # Its largest excess left out, with the whole of that collective.
        top = max(range(len(win)), key=lambda i: each[i])
        win = win[:top] + win[top + 1:]
        gap = {r: v[:top] + v[top + 1:] for r, v in gap.items()}
        comp = {r: sum(v) for r, v in gap.items()}
        inside = {r: sum((g[r][2] - g[r][1]) / 1e6 for g in win) for r in ranks}
        # Who arrived last, at the collectives that follow compute: one
        # issued at once after another (fairseq's gradients after its
        # statistics) has no one to wait for, its last arrival chance.
        m = [statistics.median(gap[r][i] for r in ranks) for i in range(len(win))]
        after = [g for g, x in zip(win, m) if x >= FOLLOWS * max(m)]
        last = [max(g, key=lambda r: g[r][1]) for g in after]
        c_o = statistics.median_high(comp[r] for r in others)
        excess = comp[s] - c_o
        span = statistics.median(comp[r] + inside[r] for r in ranks)
        waited = statistics.median(inside[r] for r in others) - inside[s]
        share = last.count(s) / len(after)
        ok = (share >= LAST_SHARE and excess >= EXCESS * span
              and excess >= REL_EXCESS * c_o and waited >= WAIT_SHARE * excess)
        strong = (ok and share == 1.0 and excess >= STRONG_EXCESS * span
                  and excess >= STRONG_REL * c_o)
        return ok and (strong or len(win) + 1 >= MIN_CALLS), {
                    "suspect": s, "collectives": len(win), "last_share": round(share, 3),
                    "strong": strong,
                    "span_ms": round(span, 1), "excess_ms": round(excess, 1),
                    "waited_ms": round(waited, 1),
                    "ranks": {str(r): {"compute_ms": round(comp[r], 1),
                                       "comm_ms": round(inside[r], 1)} for r in ranks}}

    def _lasted(self) -> bool:
        """Two looks in a row, the evidence from the first one's window on
        spanning SPAN_S."""
        looks = self.streak.looks
        return len(looks) >= 2 and looks[-1][1] - looks[0][2] >= SPAN_S * 1e9

    def _look(self) -> list[Diagnosis]:
        if self._uneven or len(self.calls) < 2:
            return []
        lead = min(self.calls)
        win = self._window(lead)
        if win is None:
            self.streak.looks = []
            return []
        t, lo = win[-1][lead][2], win[0][lead][1] - win[0][lead][0]
        if t == self._looked:
            return []                                # no new collective
        self._looked = t
        ok, self.last = self._test(win)
        s = self.last["suspect"]
        lasted = (lambda: True) if self.last["strong"] else self._lasted
        if not self.streak.step(ok, s, t, lo, lasted):
            return []
        n = self.last
        details = {"method": "cross-section", "calls": True, "at_ns": t,
                   "since_ns": self.streak.looks[0][1], **n}
        return [Diagnosis(
            "passive", "computation",
            f"rank {s} arrived last at {100 * n['last_share']:.0f}% of the job's latest "
            f"{n['collectives']} collectives and spends {n['excess_ms']:.0f} ms longer between "
            f"them than the others (of {n['span_ms']:.0f} ms), while they wait "
            f"{n['waited_ms']:.0f} ms longer inside them: it is the straggler now, whatever "
            "the job did before", None, (s,), details=details)]
