"""Iterations from a rank's call sequence: the period of the call types by
ACF, an anchor k-gram that marks where each iteration starts, and one
`IterationRecord` per iteration (duration, time in blocking calls, compute;
records in patterns.py).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from . import _kernels, exchange, onetype
from .anchors import Found, PeriodSearch, anchor_length, otsu_threshold
from .patterns import ITERATION_FIELDS, IterationRecord, PatternChange  # noqa: F401

# Calls of one type seen before each one is taken for an iteration: two
# first tries (16 calls each) that found no longer period in their gaps.
# Provisional: the longer periods 32 calls cannot show (3 repeats of at most
# 10) are looked for again as the window grows (engine/onetype.py).
ONE_CALL_MIN_CALLS = 32
# Iterations held back while the job's other ranks are asked whether a lock
# on point-to-point calls is a pipeline stage's micro-batch (the class
# docstring); past this many, the lock is taken as it is.
HOLD_MAX = 256
# Each collective's start and end go with an iteration (`arrivals`) where the
# iteration lasts this long: the cross-section reads who arrived last at
# each collective where a job's iterations are too few for its usual
# window (over WINDOW_S / MIN_WINDOW, 375 ms; diagnosis/crosssection.py),
# and a faster job's events stay small. At most ARRIVALS_MAX of them.
ARRIVALS_FROM_NS = 300_000_000
ARRIVALS_MAX = 64
# The iterations whose median duration a stretch with no anchor is judged by
# (IterationEstimator, 3.).
RELOCK_DURS = 8


class IterationEstimator(PeriodSearch):
    """Finds iterations in one rank's call stream.

    1. Period: the ACF of the call-type sequence (one-hot, so type ids are
       nominal) over a sliding window; the period is the smallest lag whose
       peak reaches ``peak_fraction`` of the highest one. When types alone do
       not lock (gloo DDP issues one all-reduce type), and only then, each
       call is also tagged by whether it follows a long host gap, which
       marks the iteration's compute phase. On a rank with point-to-point calls (a
       pipeline stage) whose window holds collectives, a period that holds
       one less than once in STEP_COLLECTIVE_EVERY (anchors.py) periods is a
       micro-batch's, not the step's, and is passed over. A lock on
       point-to-point calls alone, at its first collective, is kept only
       where its exchange runs on whole across it and every other rank of
       the job (``peers``, from the job's pipeline) repeats it
       (engine/exchange.py: decentralized SGD's neighbours), else it is
       estimated again; until every other rank has decided, the question
       stays open and its iterations are held back (a pipeline's
       micro-batches are none). Where a window's collectives are too few
       for any period it can lock to hold them once in
       STEP_COLLECTIVE_EVERY (one right after an attach), the passed-over
       period is locked as if the collective came after the lock; once
       the answer was "a step's", such periods are passed over for good.
    2. Alignment: an anchor k-gram, the one whose occurrences are most
       regularly one period apart, preferring the phase after the longest
       host gap (the iteration start). Iterations run from one anchor to the
       next, so an inserted or dropped call elsewhere does not shift them; a
       missed anchor skips iterations instead of inventing one.
    3. Re-estimation when no anchor has been seen for ``relock_after``
       periods, in calls and in time (``relock_after`` of its latest
       iterations' median), or iterations keep coming out irregular (a
       restarted job, a new pattern), reported as a PatternChange. A burst
       of other calls between two anchors is no new pattern: an
       asynchronous checkpoint's collectives, from a thread of their own,
       come 12-20 at once inside one iteration of a period of two.

    The first estimate comes after ``min_calls`` calls, then again every
    ``min_calls`` (or a quarter of the window) until one locks. 16 calls
    find periods up to 5 calls (3 repeats); a job already slow at attach,
    at a few iterations per second, locked at 1.9 s instead of 4.0 s on the
    corpus's tune recording (preslow-user4-r2-strong), and no replay of the
    corpus changed otherwise. Longer periods lock on a later try.

    A rank whose every call is one type (function, communicator, size) and
    whose host gaps show no phases repeating has one call per iteration (a
    small model's gradients in one DDP bucket): after ONE_CALL_MIN_CALLS
    calls with no longer period found, each call is an iteration (period 1,
    from one call's end to the next one's). A call of another type later
    breaks the match and the period is estimated again. A period of one is
    provisional, and a period of one type's calls seen in their gaps alone
    is taken only as the job's other ranks (``offers``, from the job's
    pipeline) agree: engine/onetype.py.

    Until a period is locked, ``state`` is "warming_up" and nothing is
    guessed.
    """

    def __init__(self, *, rank: int | None = None, window: int = 4096, max_period: int = 500,
                 min_period: int = 2, min_repeats: int = 3, peak_fraction: float = 0.8,
                 min_peak: float = 0.05, min_anchor_score: float = 0.5, anchor_k: int = 4,
                 tolerance: float = 0.1, relock_after: float = 4.0, min_calls: int = 16):
        if not 2 <= min_period <= max_period:
            raise ValueError("2 <= min_period <= max_period")
        if window < min_repeats * max_period:
            raise ValueError(f"window must hold {min_repeats} x max_period calls")
        self.rank = rank
        self.window = window
        self.max_period, self.min_period, self.min_repeats = max_period, min_period, min_repeats
        self.peak_fraction, self.min_peak = peak_fraction, min_peak
        self.min_anchor_score, self.anchor_k, self.tolerance = min_anchor_score, anchor_k, tolerance
        self.relock_after, self.min_calls = relock_after, min_calls

        # The job's other ranks' `rhythm` now (set by the job's pipeline,
        # read only when a decision needs them); None: a rank alone.
        self.peers: Callable[[], list[int | None]] | None = None
        # Their `offer` now: a period of one call type's gaps is taken as they agree.
        self.offers: Callable[[], list[int | None]] | None = None
        self.reset()

    def reset(self) -> None:
        self._types = np.empty(0, dtype=np.int64)
        self._start = np.empty(0, dtype=np.int64)
        self._end = np.empty(0, dtype=np.int64)
        self._block = np.empty(0, dtype=bool)
        self._p2p = np.empty(0, dtype=bool)
        self._coll = np.empty(0, dtype=bool)
        self._gap = np.empty(0, dtype=np.int64)
        self._offset = 0            # global call index of buffer position 0
        self._last_call_start = None
        self.state = "warming_up"
        self.period: int | None = None
        self._p2p_only = False      # locked on point-to-point calls, no collective seen
        self._p2p_lock = False      # the lock was made on point-to-point calls alone
        self._step_check = False    # a collective came: a pipeline step's? (the peers say)
        self._strict = False        # the peers said a step's: no lock waives the rule again
        self._held: list | None = None   # iterations while _step_check is open
        self._judged = 0            # global index: collectives before it judged (exchange.breaks)
        self._own_ok = False        # a collective judged so, the exchange whole across it
        self._short = False         # the last candidate period did not fit the window yet
        self._anchor: np.ndarray | None = None
        self._gap_thr: int | None = None   # ns; None: gap classes not used
        self._last_anchor: int | None = None  # global index
        self._prev_end: int | None = None     # end of the previous iteration (ns)
        self._scanned = 0           # global index up to which anchors were searched
        self._match_from = 0        # global index: where the lock's matching began
        self._irregular = 0
        self._durs: deque = deque(maxlen=RELOCK_DURS)  # the lock's latest iterations (ns)
        self._seen = 0              # calls fed so far
        self._try_at = self.min_calls   # call count at which to estimate next
        self._one_from: int | None = None  # global index: a provisional period of one's calls
        self._one_reach = 0         # the longest period its lock's search could see
        self._proposal: tuple[int, Found] | None = None  # (global lo, found): onetype.py
        self._one_type = False      # the lock's calls were all of one type
        self.index = 0
        self.skipped = 0

    # -- feeding -----------------------------------------------------------------

    def feed(self, types, start_ns, dur_ns, blocking=None, p2p=None, collective=None) -> list:
        """Add calls (in start order); returns IterationRecords and
        PatternChanges in the order they happened. The result does not
        depend on how the calls are split into batches. `blocking`: calls
        the host waits in (all, if not given); `p2p`: which of them are
        point-to-point (none, if not given); `collective`: which calls are
        collectives (none, if not given)."""
        types = np.asarray(types, dtype=np.int64)
        start = np.asarray(start_ns, dtype=np.int64)
        dur = np.asarray(dur_ns, dtype=np.int64)
        block = (np.ones(len(types), dtype=bool) if blocking is None
                 else np.asarray(blocking, dtype=bool))
        pp = (np.zeros(len(types), dtype=bool) if p2p is None
              else np.asarray(p2p, dtype=bool))
        co = (np.zeros(len(types), dtype=bool) if collective is None
              else np.asarray(collective, dtype=bool))
        if not (types.ndim == start.ndim == dur.ndim == block.ndim == pp.ndim == co.ndim == 1
                and len(types) == len(start) == len(dur) == len(block) == len(pp)
                == len(co)):
            raise ValueError("types, start_ns, dur_ns, blocking, p2p and collective differ "
                             "in length")
        if len(types) == 0:
            return []
        if types.min() < 0:
            raise ValueError("call types must be non-negative")
        out: list = []
        i = 0
        while i < len(types):
            # Stop at the call count where an estimate is due, so estimates
            # happen at the same calls whatever the batch boundaries.
            j = len(types)
            if self.state != "locked" or self._one_from is not None:
                j = min(j, i + max(1, self._try_at - self._seen))
            out += self._feed(types[i:j], start[i:j], start[i:j] + dur[i:j], block[i:j],
                              pp[i:j], co[i:j])
            i = j
        return out

    def _feed(self, types, start, end, block, p2p, coll) -> list:
        prev = self._last_call_start if self._last_call_start is not None else start[0]
        gap = np.diff(start, prepend=prev)
        self._last_call_start = int(start[-1])
        self._types = np.concatenate([self._types, types])
        self._start = np.concatenate([self._start, start])
        self._end = np.concatenate([self._end, end])
        self._block = np.concatenate([self._block, block])
        self._p2p = np.concatenate([self._p2p, p2p])
        self._coll = np.concatenate([self._coll, coll])
        self._gap = np.concatenate([self._gap, gap])
        self._seen += len(types)
        out: list = []
        if self.state == "locked" and self._p2p_only and coll.any():
            self._p2p_only, self._step_check, self._held = False, True, []
        if self.state == "locked" and self._p2p_lock and not self._p2p_only \
                and (step := self._decide()) is not None:
            self._step_check = False
            held, self._held = self._held or [], None
            if not step:
                out += held
            else:                       # micro-batches, not steps: dropped
                # A pipeline stage locked on its micro-batches' sends and
                # receives before its step's first collective: the step is
                # longer. Estimated again over every call kept, that one too,
                # and the rule holds from now on (a rank alone never loops).
                self.state = "relocking"
                self._strict = True
                self._try_at = self._seen
                self._last_anchor = None
        if self.state == "locked":
            out += self._match()
        if self.state == "locked" and self._one_from is not None:
            out += self._recheck_one()
        if self.state != "locked" and (self._seen >= self._try_at or self._proposal):
            self._held = None           # an open question's iterations: not the new lock's
            # (a period proposed: taken if the job's other ranks agree now)
            change = self._estimate() if self._seen >= self._try_at else self._take_proposal()
            if change:
                out.append(change)
                out += self._match()
        if self._held is not None:
            # Undecided: a pipeline stage's micro-batches are no iterations,
            # a peer's exchange's are. Held until the peers say.
            self._held += [o for o in out if isinstance(o, IterationRecord)]
            out = [o for o in out if not isinstance(o, IterationRecord)]
            if len(self._held) >= HOLD_MAX:     # too long undecided: taken as locked
                out, self._held = self._held + out, None
        self._trim()
        return out

    @property
    def rhythm(self) -> int | None:
        """What the job's other ranks read of this one: None until locked,
        the period while locked on point-to-point calls alone (None while a
        collective that came is not judged yet), 0 while locked otherwise."""
        if self.state != "locked":
            return None
        if not self._p2p_lock:
            return 0
        # A collective came: undecided until its own exchange is seen whole.
        return None if self._step_check and not self._own_ok else self.period

    def _decide(self) -> bool | None:
        """For a lock on point-to-point calls that a collective came to:
        True where the collective is a pipeline step's (estimated again),
        False where the lock is kept, None while undecided or decided."""
        judged = self._judged
        verdict, lo, whole = exchange.breaks(self._types, self._coll,
                                             max(judged - self._offset, 0), self.period)
        self._judged = self._offset + lo
        self._own_ok |= whole
        if verdict:
            return True
        if self._step_check:
            return exchange.peers_say(self.peers() if self.peers else [], self.period) \
                if self._own_ok else None
        if self._judged != judged and self.peers and 0 in self.peers():
            return True     # kept, and a peer has since locked on a step: a pipeline's
        return None

    def _n_since_anchor(self) -> int:
        base = self._last_anchor if self._last_anchor is not None \
            else max(self._offset, self._match_from)
        return self._offset + len(self._types) - base

    def _tokens(self, lo: int, hi: int) -> np.ndarray:
        t = self._types[lo:hi]
        if self._gap_thr is None:
            return t
        return t * 2 + (self._gap[lo:hi] > self._gap_thr)

    # -- period and anchor -----------------------------------------------------------

    def _recheck_one(self) -> list:
        """A provisional period of one: its calls searched again as they grow,
        for a longer period its lock's search could not reach (onetype.py)."""
        lo = max(self._one_from - self._offset, 0)
        if len(self._types) - lo >= self.window:
            self._one_from = self._proposal = None   # a whole window of it: it stands
            return []
        if self._seen >= self._try_at:
            found = self._search(lo, one_call=False)
            if found is not None and found.period > self._one_reach:
                self._proposal = (self._offset + lo, found)
        scanned = self._scanned
        change = self._take_proposal()
        if change is None:
            return []
        # Its iterations from here on (the calls before were reported), and
        # its first anchor looked for from here, not from its calls' start.
        self._scanned = self._match_from = max(self._scanned, scanned - len(self._anchor))
        return [change] + self._match()

    def _take_proposal(self) -> PatternChange | None:
        """Locks on the period proposed where the job's other ranks agree."""
        if self._proposal is None:
            return None
        start, found = self._proposal
        if start < self._offset:
            self._proposal = None           # its calls are gone: searched again later
            return None
        if not onetype.agree(self.offers() if self.offers else None, found.period):
            return None
        return self._lock(start - self._offset, found)

    @property
    def offer(self) -> int | None:
        """What the job's other ranks read of this one (onetype.agree): the
        period proposed, else the one locked on where its calls are of one
        type, 0 where of several, None while not locked."""
        if self._proposal is not None:
            return self._proposal[1].period
        if self.state != "locked":
            return None
        return self.period if self._one_type else 0

    def _estimate(self) -> PatternChange | None:
        # Estimate on the calls since the last anchor (a new pattern), at most a window.
        lo = max(0, len(self._types) - self.window)
        if self._last_anchor is not None:
            # Relocking: from after the last iteration that began under the
            # old pattern. Its calls are the old pattern's, and with them in
            # the window a new pattern of one call type never read as one
            # (post-local SGD: DDP's buckets, then only the parameters'
            # all-reduce; examples/local_sgd.py was never relocked).
            lo = max(lo, min(self._last_anchor - self._offset + (self.period or 0),
                             len(self._types)))
        return self._estimate_from(lo, one_call=True)

    def _estimate_from(self, lo: int, one_call: bool) -> PatternChange | None:
        self._proposal = None
        found = self._search(lo, one_call)
        if found is None:
            return None
        toks = self._types[lo:]
        if found.period > 1 and found.thr is not None and toks.min() == toks.max() \
                and self.offers:
            # One call type, its period in its gaps alone: taken as the job's
            # other ranks agree, a provisional period of one meanwhile.
            self._proposal = (self._offset + lo, found)
            change = self._take_proposal()
            if change is not None or len(toks) < ONE_CALL_MIN_CALLS:
                return change
            found = Found.of_one(len(toks), found.colls, found.nlags)
        return self._lock(lo, found)

    def _search(self, lo: int, one_call: bool) -> Found | None:
        """The period of the calls from buffer position lo on, and its
        anchor's phase, gap threshold and longest lag searched; None: none."""
        n = len(self._types) - lo
        # A pipeline stage's step holds its collective (anchors.STEP_COLLECTIVE_EVERY).
        colls = int(self._coll[lo:].sum()) if self._p2p[lo:].any() else 0
        nlags = min(self.max_period, n // self.min_repeats)
        if nlags < self.min_period:
            self._try_at = self._seen + self.min_calls
            return None
        best = None
        for use_gaps in (False, True):
            thr = otsu_threshold(self._gap[lo:]) if use_gaps else None
            if use_gaps and thr is None:
                continue
            self._gap_thr = thr
            toks = self._tokens(lo, len(self._types))
            self._short = False
            found = self._period_and_anchor(toks, self._gap[lo:], nlags, colls)
            self._gap_thr = None
            if not found and self._short:
                break   # the types' anchor needs more calls: gap classes would miss anchors
            if found:
                best = (*found, thr)
                # Call types do not change when a rank slows; its host gaps
                # do (a throttled rank's short gaps turn long at random), so
                # the types alone are kept whenever they lock at all. Gap
                # classes preferred on a better anchor score lost up to 13 s
                # of a throttled PPO rank's iterations (examples/ppo_rollout.py).
                break
        # Let the window grow before trying again.
        self._try_at = self._seen + max(self.min_calls, n // 4)
        one = best is None and one_call and n >= ONE_CALL_MIN_CALLS \
            and (toks0 := self._types[lo:]).min() == toks0.max()
        if one:
            # One call type, and its gaps split it into no repeating phases:
            # one call per iteration (a small model's one DDP bucket).
            return Found.of_one(len(toks0), colls, nlags)
        return None if best is None else Found(*best, colls, nlags, False)

    def _lock(self, lo: int, found: Found) -> PatternChange:
        """Lock on a period `_search` found (its phase: an index into the window from lo)."""
        period, phase, score, peak, waived, thr, colls, nlags, one = found
        self._one_from = self._offset + lo if one else None
        self._one_reach = nlags
        if not one:
            self._proposal = None       # (a period of one meanwhile keeps it)
        self._one_type = bool(self._types[lo:].min() == self._types[lo:].max())
        self._gap_thr = thr
        toks = self._tokens(lo, len(self._types))
        kk = anchor_length(period, int(toks.max()) + 1, self.anchor_k)
        self._anchor = toks[phase:phase + kk].copy()
        previous = self.period
        self.period = period
        self._p2p_only = colls == 0 and bool(self._p2p[lo:].any())
        self._p2p_lock = self._p2p_only or waived
        self._step_check = waived
        self._held = [] if waived else None
        self._judged = self._offset + lo
        self._own_ok = False
        self.state = "locked"
        self._irregular = 0
        self._durs.clear()
        self._scanned = self._match_from = self._offset + lo
        self._last_anchor = None
        self._prev_end = None
        return PatternChange(self.rank, period, previous,
                             "locked" if previous is None else "changed",
                             int(self._start[-1]), peak, score, thr is not None)

    # -- matching --------------------------------------------------------------------

    def _match(self) -> list:
        out = []
        k = len(self._anchor)
        lo = max(self._scanned - self._offset, 0)
        toks = self._tokens(lo, len(self._types))
        pos = _kernels.find_gram(toks, self._anchor) + lo
        self._scanned = self._offset + max(lo, len(self._types) - k + 1)
        P = self.period
        for p in pos.tolist():
            g_abs = p + self._offset
            if self._last_anchor is None:
                self._last_anchor = g_abs
                self._prev_end = self._period_end(p)
                continue
            gap = g_abs - self._last_anchor
            if gap < P * (1 - self.tolerance):
                continue                       # a spurious match inside an iteration
            a = self._last_anchor - self._offset
            end = self._period_end(p)
            if gap <= P * (1 + self.tolerance) and self._prev_end is not None:
                out.append(self._record(a, p, self._prev_end, end))
                self._durs.append(end - self._prev_end)
                self.index += 1
                self._irregular = 0
            else:
                m = max(1, round(gap / P))
                self.index += m
                self.skipped += m
                self._irregular += gap > P * (1 + self.tolerance)
            self._prev_end = end
            self._last_anchor = g_abs
        if self._irregular >= 5 or self._stalled(k):
            self.state = "relocking"
            self._try_at = self._seen
            if self._irregular >= 5:
                self._last_anchor = self._offset + len(self._types) - 1
            self._irregular = 0
        return out

    def _stalled(self, k: int) -> bool:
        """No anchor for `relock_after` periods of calls (and its anchor's
        k calls), and for `relock_after` times its latest iterations' median
        duration, where it has any."""
        if self._n_since_anchor() <= self.relock_after * self.period + k:
            return False
        if not self._durs or self._last_anchor is None:
            return True
        since = int(self._start[-1]) - int(self._start[self._last_anchor - self._offset])
        return since > self.relock_after * float(np.median(self._durs))

    def _period_end(self, b: int) -> int | None:
        """When the iteration before anchor position b finished: the last end
        among the period's calls before it. The host's last wait of an
        iteration (the final bucket's all-reduce, a sync) ends right before
        the optimizer step, so this boundary sits next to the trainer's own,
        where the anchor (often mid-backward) does not. None when that
        period is not in the buffer."""
        lo = b - self.period
        return int(self._end[lo:b].max()) if lo >= 0 else None

    def _record(self, a: int, b: int, start: int, stop: int) -> IterationRecord:
        sel = self._block[a:b]
        s_ = np.clip(self._start[a:b][sel], start, stop)
        e_ = np.clip(self._end[a:b][sel], start, stop)
        dur = max(stop - start, 1)
        comm = min(int(_kernels.union_ns(s_, e_)), dur)
        pp = self._p2p[a:b][sel]
        p2p = min(int(_kernels.union_ns(s_[pp], e_[pp])), comm)
        arrivals: tuple[int, ...] = ()
        if dur >= ARRIVALS_FROM_NS:
            co = (self._coll[a:b] & self._block[a:b] & ~self._p2p[a:b]).nonzero()[0][:ARRIVALS_MAX]
            pairs = np.stack([self._start[a:b][co], self._end[a:b][co]], axis=1)
            arrivals = tuple(((pairs.ravel() - start) // 1000).tolist())
        return IterationRecord(self.rank, self.index, start, dur, b - a, comm, dur - comm, p2p,
                               self.period, arrivals)

    def _trim(self) -> None:
        keep_from = len(self._types) - self.window
        if self._last_anchor is not None:
            keep_from = min(keep_from, self._last_anchor - self._offset - (self.period or 0))
        keep_from = min(keep_from, self._scanned - self._offset - self.anchor_k)
        if keep_from > 0:
            for name in ("_types", "_start", "_end", "_block", "_p2p", "_coll", "_gap"):
                setattr(self, name, getattr(self, name)[keep_from:])
            self._offset += keep_from
