"""The streaming engine: iteration time from the call sequence (ACF), and
online slowdown detection on iteration times (BOCD).

Data flow per rank: call records -> IterationEstimator -> IterationRecord ->
SlowdownDetector -> ChangePoint. The classes here validate arguments and
hold state; the hot loops are Numba kernels in greyhound_bpf._kernels. The
engine takes plain arrays and records, so it runs the same on live tracer
batches, on a replayed JSON-lines file, or on synthetic data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _kernels

# -- BOCD --------------------------------------------------------------------

# Hypotheses lighter than PRUNE_MASS are dropped and at most MAX_RUNS kept,
# so an update costs O(MAX_RUNS) at any length. 1e-6 loses no change point
# of the reference (unpruned) BOCD on the test series; 64 runs cover the
# uncertainty about where a segment started many times over.
PRUNE_MASS = 1e-6
MAX_RUNS = 64


class RunLengthSummary(NamedTuple):
    """What one BOCD update says about the current segment. (A NamedTuple:
    it is made once per observation, and a frozen dataclass costs more
    than the pruned update itself.)"""
    t: int                  # observations seen so far
    map_run_length: int     # most probable number of observations in the current segment
    map_probability: float  # its posterior mass
    segment_start: int      # index of the first observation of the MAP segment
    evidence: float         # log p(x_t | x_1..t-1)
    n_hypotheses: int       # run lengths kept after pruning


class BOCD:
    """Online Bayesian change-point detection (Adams & MacKay, 2007).

    Gaussian observations with unknown mean and variance under a
    Normal-Gamma(mu0, kappa0, alpha0, beta0) prior, a constant hazard
    (probability of a change before each observation), and run-length
    pruning. ``update(x)`` returns a RunLengthSummary; the run-length
    posterior itself is available read-only through ``run_lengths`` and
    ``probabilities``.
    """

    def __init__(self, *, hazard: float = 1 / 250, mu0: float = 0.0, kappa0: float = 1.0,
                 alpha0: float = 1.0, beta0: float = 1.0, prune: float = PRUNE_MASS,
                 max_runs: int = MAX_RUNS):
        if not 0 < hazard < 1:
            raise ValueError(f"hazard must be in (0, 1), not {hazard}")
        if kappa0 <= 0 or alpha0 <= 0 or beta0 <= 0:
            raise ValueError("kappa0, alpha0 and beta0 must be positive")
        if max_runs < 1 or not 0 < prune < 1:
            raise ValueError("max_runs >= 1 and 0 < prune < 1")
        self.hazard, self.mu0, self.kappa0 = hazard, mu0, kappa0
        self.alpha0, self.beta0 = alpha0, beta0
        self.prune, self.max_runs = prune, max_runs
        self._params = np.array([math.log(hazard), math.log1p(-hazard), mu0, kappa0, alpha0,
                                 beta0, math.log(prune), max_runs], dtype=np.float64)
        self.reset()

    def reset(self) -> None:
        cap = self.max_runs + 2
        self._a = np.zeros((_kernels.NROWS, cap))
        self._b = np.zeros((_kernels.NROWS, cap))
        self._n = 0
        self._t = 0

    @property
    def t(self) -> int:
        return self._t

    @property
    def run_lengths(self) -> np.ndarray:
        return self._a[_kernels.RL, :self._n].astype(np.int64)

    @property
    def probabilities(self) -> np.ndarray:
        return np.exp(self._a[_kernels.LOGP, :self._n])

    def probability_run_at_most(self, r: int) -> float:
        """Posterior mass of a segment no longer than r observations: the
        probability that a change happened within the last r observations."""
        return float(_kernels.mass_run_at_most(self._a, self._n, float(r)))

    def update(self, x: float) -> RunLengthSummary:
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"observation must be finite, not {x}")
        n, evidence, r, p = _kernels.bocd_step(x, self._n, self._a, self._b, self._params)
        self._a, self._b = self._b, self._a
        self._n = n
        self._t += 1
        return RunLengthSummary(self._t, r, p, self._t - r, evidence, n)


def default_prior(x: np.ndarray) -> dict:
    """A data-scaled Normal-Gamma prior: centred on the median, with the
    noise scale of the first differences (robust to level shifts)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return {"mu0": float(x[0]) if len(x) else 0.0, "kappa0": 0.1, "alpha0": 1.0, "beta0": 1.0}
    d = np.diff(x)
    mad = np.median(np.abs(d - np.median(d))) * 1.4826 / math.sqrt(2)
    scale = mad if mad > 0 else (np.std(x) or 1.0)
    return {"mu0": float(np.median(x)), "kappa0": 0.1, "alpha0": 1.0, "beta0": float(scale ** 2)}


def changepoints(x, *, hazard: float = 1 / 100, mu0: float | None = None,
                 kappa0: float | None = None, alpha0: float | None = None,
                 beta0: float | None = None, prune: float = PRUNE_MASS,
                 max_runs: int = MAX_RUNS) -> list[int]:
    """Change points of a series by online BOCD (Adams & MacKay 2007).

    Runs the pruned online BOCD over ``x`` once, recording the MAP run length
    after every observation, then reads the MAP segmentation back from the
    end: the segment holding the last observation starts at T - r_T, the one
    before it ends just before that, and so on. Returns the index of the
    first observation of every segment but the first (0 is never returned),
    in increasing order.

    Parameters not given come from ``default_prior(x)``: mean at the median
    of x, noise scale from the median absolute first difference. ``hazard``
    is the prior probability of a change before each observation.
    """
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float64))
    if x.ndim != 1:
        raise ValueError("changepoints expects a 1-D series")
    if len(x) == 0:
        return []
    if not np.all(np.isfinite(x)):
        raise ValueError("changepoints expects finite values")
    p = default_prior(x)
    mu0 = p["mu0"] if mu0 is None else mu0
    kappa0 = p["kappa0"] if kappa0 is None else kappa0
    alpha0 = p["alpha0"] if alpha0 is None else alpha0
    beta0 = p["beta0"] if beta0 is None else beta0
    b = BOCD(hazard=hazard, mu0=mu0, kappa0=kappa0, alpha0=alpha0, beta0=beta0,
             prune=prune, max_runs=max_runs)
    maprl = _kernels.bocd_run(x, b._params)
    return map_segment_starts(maprl)


def map_segment_starts(maprl: np.ndarray) -> list[int]:
    """Segment starts from the MAP run length after each observation."""
    cps = []
    t = len(maprl) - 1
    while t >= 0:
        start = t - int(maprl[t]) + 1
        if start <= 0:
            break
        cps.append(start)
        t = start - 1
    return sorted(cps)


# -- slowdown detection ---------------------------------------------------------

@dataclass(frozen=True)
class ChangePoint:
    """A detected level change of the iteration time."""
    kind: str            # "slowdown" or "recovery"
    scope: str           # "job" or "rank N"
    index: int           # observation index (iteration) where the new level starts
    detected_at: int     # observation index at which it was detected
    before_ms: float
    after_ms: float
    ratio: float         # after / before
    probability: float   # posterior mass of a change within the new segment

    def fields(self) -> dict:
        return {"scope": self.scope, "index": self.index, "detected_index": self.detected_at,
                "before_ms": round(self.before_ms, 4), "after_ms": round(self.after_ms, 4),
                "ratio": round(self.ratio, 4), "probability": round(self.probability, 4)}


class SlowdownDetector:
    """Reads iteration times one at a time and reports level changes.

    The times go through log() (a slowdown is a ratio) and a running median
    of 3 (a one-iteration spike, such as a GC pause, vanishes; a real level
    change passes one iteration late) into a BOCD. When the BOCD's MAP
    segment starts after the last accepted change with posterior mass of at
    least ``min_probability``, the new segment is compared with up to
    ``history`` iterations before it, robustly (medians, MAD scale):

    - the shift must be significant: the mean of the new values, clipped
      to 3 noise scales around the old level, is ``min_z`` standard errors
      away from it, so a few unlucky iterations of noise do not alarm;
    - it must be at least ``threshold`` in size: the ratio's one-standard-
      error upper bound reaches 1 + threshold (a true 10% slowdown is
      estimated below 10% half of the time; requiring the point estimate
      to pass would miss it that often).

    A slower new level is a ``slowdown``, a faster one a ``recovery``; a
    speed-up is never a slowdown.

    A slow level may be too short and too noisy for the faster one after it
    to pass these tests against it (20 iterations at x1.2 with 20% noise
    give z of about 3), and the BOCD then keeps its segment start there:
    the detector would stay slow for good (on 85 of 486 synthetic series
    of such stretches). So while slow, the last ``2 * history`` iterations
    are also compared with the healthy level that the first slowdown was
    measured against: when their median is back within half the threshold
    of it, that is a ``recovery`` too. (A window of `history` also ended
    some persistent, noisy 15-20% slowdowns.)
    """

    # Keep at most this many iterations; older ones are never compared again.
    MAX_KEPT = 4096
    # Iterations whose first differences give the long-run noise scale.
    SCALE_WINDOW = 500

    def __init__(self, *, scope: str = "job", threshold: float = 0.10,
                 min_probability: float = 0.9, min_z: float = 4.5, hazard: float = 1 / 250,
                 warmup: int = 10, min_segment: int = 3, history: int = 50):
        if threshold <= 0:
            raise ValueError("threshold must be positive")
        if not 0 < min_probability <= 1:
            raise ValueError("min_probability must be in (0, 1]")
        if warmup < 3 or min_segment < 1 or min_z <= 0:
            raise ValueError("warmup >= 3, min_segment >= 1, min_z > 0")
        self.scope = scope
        self.threshold = threshold
        self.min_probability = min_probability
        self.min_z = min_z
        self.hazard = hazard
        self.warmup = warmup            # iterations that set the prior; no detection before
        self.min_segment = min_segment  # observations a new level needs before it is believed
        self.history = history          # observations of the old level compared against
        self.reset()

    def reset(self) -> None:
        self._logs = np.empty(self.MAX_KEPT)   # log iteration times, _len of them kept
        self._len = 0
        self._base = 0                  # iteration index of _logs[0]
        self._bocd: BOCD | None = None
        self._accepted_start = 0        # start of the segment the detector believes in
        self._healthy = None            # log level before the first slowdown, while slow
        self._diff_scale = 0.0          # noise scale from recent first differences
        self._diff_scale_at = -1
        self.state = "warming_up"       # warming_up, ok, slow

    @property
    def n(self) -> int:
        return self._base + self._len

    def update(self, x: float) -> ChangePoint | None:
        x = float(x)
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"iteration time must be positive and finite, not {x}")
        if self._len == self.MAX_KEPT:
            keep = self.MAX_KEPT // 2
            self._logs[:keep] = self._logs[self._len - keep:self._len]
            self._base += self._len - keep
            self._len = keep
        self._logs[self._len] = math.log(x)
        self._len += 1
        t = self.n - 1
        if self._bocd is None:
            if self.n < self.warmup:
                return None
            base = self._logs[:self._len].copy()
            p = default_prior(base)
            self._bocd = BOCD(hazard=self.hazard, mu0=p["mu0"], kappa0=0.05, alpha0=2.0,
                              beta0=2.0 * max(p["beta0"], 1e-6))
            self.state = "ok"
            for i in range(self.n):
                self._bocd.update(self._filtered(i))
            return None
        s = self._bocd.update(self._filtered(t))
        if self.n < 3 * self.warmup:
            return None     # the noise scale is not known well enough yet
        cp = self._level_change(s, t)
        if cp is None and self.state == "slow":
            cp = self._back_to_healthy(s, t)
        if cp is not None:
            if cp.kind == "slowdown" and self.state != "slow":
                self._healthy = math.log(cp.before_ms)
            self._accepted_start = cp.index
            self.state = "slow" if cp.kind == "slowdown" else "ok"
            if self.state == "ok":
                self._healthy = None
        return cp

    def _level_change(self, s: RunLengthSummary, t: int) -> ChangePoint | None:
        """The BOCD's new segment, if it is a reportable change."""
        # The filter delays a level change by one observation: its segment
        # start in raw indices is one earlier than BOCD's.
        start = max(s.segment_start - 1, self._base)
        if start <= self._accepted_start or t - start + 1 < self.min_segment:
            return None
        # Mass of "a change within the new segment, give or take": runs that
        # start a few observations before the MAP start are nearly as likely
        # (the boundary is uncertain) and must count, or a clear change reads
        # as 60%; runs twice as long as the new segment are the old level.
        r = s.map_run_length
        prob = self._bocd.probability_run_at_most(r + max(5, r))
        if prob < self.min_probability:
            return None
        need = max(self.min_segment, self.warmup)
        old_lo = max(self._accepted_start, start - self.history, self._base)
        new = self._logs[start - self._base:t + 1 - self._base]
        brief = None
        if start - old_lo < need:
            # The level accepted last lasted only a few iterations before this
            # change: too little to compare against, and the MAP start stays
            # here, so waiting would never report it. Compare with the window
            # before it, if the new level also differs from the brief one by
            # twice the threshold and half the shift, in the same direction
            # (a boundary that only moved within one level is no new change).
            brief = self._logs[old_lo - self._base:start - self._base]
            old_lo = max(start - self.history, self._base)
            if start - old_lo < need or brief.size < self.min_segment:
                return None     # too little of the old level to compare against
        old = self._logs[old_lo - self._base:start - self._base]
        # Noise floor: the recent first differences (robust to level
        # shifts); 50 samples of the old level can underestimate the noise by
        # a third, and z would then be inflated. Refreshed every 25
        # iterations: it moves slowly and costs a median of 500.
        if self._diff_scale_at < 0 or t - self._diff_scale_at >= 25:
            recent = np.diff(self._logs[max(0, self._len - self.SCALE_WINDOW):self._len])
            self._diff_scale = 1.4826 * float(np.median(np.abs(recent))) / math.sqrt(2)
            self._diff_scale_at = t
        code, m_old, m_new = _kernels.level_shift(old, new, self._diff_scale, self.min_z,
                                                   math.log1p(self.threshold))
        if code == 0:
            return None
        if brief is not None:
            step = float(np.median(new)) - float(np.median(brief))
            if step * code < max(2 * math.log1p(self.threshold), 0.5 * abs(m_new - m_old)):
                return None
        kind = "slowdown" if code > 0 else "recovery"
        return ChangePoint(kind, self.scope, start, t, math.exp(m_old), math.exp(m_new),
                           math.exp(m_new - m_old), prob)

    def _back_to_healthy(self, s: RunLengthSummary, t: int) -> ChangePoint | None:
        """While slow: the last `2 * history` iterations, all after the slow
        level began, back within half the threshold of the healthy level."""
        lo = t + 1 - 2 * self.history
        if self._healthy is None or lo <= self._accepted_start or lo < self._base:
            return None
        recent = self._logs[lo - self._base:t + 1 - self._base]
        m_new = float(np.median(recent))
        if m_new > self._healthy + 0.5 * math.log1p(self.threshold):
            return None
        slow = self._logs[max(self._accepted_start, self._base) - self._base:lo - self._base]
        m_old = float(np.median(slow))
        if m_old <= m_new:
            return None
        # Where the faster level began: the BOCD's segment start when it
        # lies in the slow stretch, else the start of the window.
        start = max(s.segment_start - 1, self._base)
        start = start if self._accepted_start < start <= lo else lo
        return ChangePoint("recovery", self.scope, start, t, math.exp(m_old), math.exp(m_new),
                           math.exp(m_new - m_old), self._bocd.probability_run_at_most(t - start + 1))

    def _filtered(self, i: int) -> float:
        j = i - self._base
        w = sorted(self._logs[max(0, j - 2):j + 1].tolist())
        return w[len(w) // 2]


# -- iteration estimation -------------------------------------------------------

@dataclass(frozen=True)
class IterationRecord:
    rank: int | None
    index: int           # iteration number since the pattern was locked
    start_ns: int        # end of the previous iteration's last call
    dur_ns: int          # to the end of this iteration's last call
    period_calls: int    # calls in this iteration
    comm_ns: int         # time inside blocking calls (union over threads)
    compute_ns: int      # dur_ns - comm_ns

    def fields(self) -> dict:
        return {"rank": self.rank, "index": self.index, "start_ns": self.start_ns,
                "dur_ns": self.dur_ns, "period_calls": self.period_calls,
                "comm_ns": self.comm_ns, "compute_ns": self.compute_ns}


@dataclass(frozen=True)
class PatternChange:
    """The per-iteration call pattern was (re-)estimated."""
    rank: int | None
    period_calls: int
    previous: int | None   # the period before, None the first time
    reason: str            # "locked" (first estimate) or "changed"
    at_ns: int
    acf_peak: float        # adjusted ACF at the period
    anchor_score: float    # share of iterations the anchor marks cleanly
    gap_classes: bool      # whether long host gaps were needed to see the period

    def fields(self) -> dict:
        return {"rank": self.rank, "period_calls": self.period_calls, "previous": self.previous,
                "reason": self.reason, "acf_peak": round(self.acf_peak, 4),
                "anchor_score": round(self.anchor_score, 4), "gap_classes": self.gap_classes}


class IterationEstimator:
    """Finds iterations in one rank's call stream.

    1. Period: the ACF of the call-type sequence (one-hot, so type ids are
       nominal) over a sliding window; the period is the smallest lag whose
       peak reaches ``peak_fraction`` of the highest one. When types alone do
       not repeat (gloo DDP issues one all-reduce type), each call is also
       tagged by whether it follows a long host gap, which marks the
       iteration's compute phase.
    2. Alignment: an anchor k-gram, the one whose occurrences are most
       regularly one period apart, preferring the phase after the longest
       host gap (the iteration start). Iterations run from one anchor to the
       next, so an inserted or dropped call elsewhere does not shift them; a
       missed anchor skips iterations instead of inventing one.
    3. Re-estimation when no anchor has been seen for ``relock_after``
       periods or iterations keep coming out irregular (a restarted job, a
       new pattern), reported as a PatternChange.

    Until a period is locked, ``state`` is "warming_up" and nothing is
    guessed.
    """

    def __init__(self, *, rank: int | None = None, window: int = 4096, max_period: int = 500,
                 min_period: int = 2, min_repeats: int = 3, peak_fraction: float = 0.8,
                 min_peak: float = 0.05, min_anchor_score: float = 0.5, anchor_k: int = 4,
                 tolerance: float = 0.1, relock_after: float = 4.0, min_calls: int = 32):
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
        self.reset()

    def reset(self) -> None:
        self._types = np.empty(0, dtype=np.int64)
        self._start = np.empty(0, dtype=np.int64)
        self._end = np.empty(0, dtype=np.int64)
        self._block = np.empty(0, dtype=bool)
        self._gap = np.empty(0, dtype=np.int64)
        self._offset = 0            # global call index of buffer position 0
        self._last_call_start = None
        self.state = "warming_up"
        self.period: int | None = None
        self._anchor: np.ndarray | None = None
        self._gap_thr: int | None = None   # ns; None: gap classes not used
        self._last_anchor: int | None = None  # global index
        self._prev_end: int | None = None     # end of the previous iteration (ns)
        self._scanned = 0           # global index up to which anchors were searched
        self._irregular = 0
        self._seen = 0              # calls fed so far
        self._try_at = self.min_calls   # call count at which to estimate next
        self.index = 0
        self.skipped = 0

    # -- feeding -----------------------------------------------------------------

    def feed(self, types, start_ns, dur_ns, blocking=None) -> list:
        """Add calls (in start order); returns IterationRecords and
        PatternChanges in the order they happened. The result does not
        depend on how the calls are split into batches."""
        types = np.asarray(types, dtype=np.int64)
        start = np.asarray(start_ns, dtype=np.int64)
        dur = np.asarray(dur_ns, dtype=np.int64)
        block = (np.ones(len(types), dtype=bool) if blocking is None
                 else np.asarray(blocking, dtype=bool))
        if not (types.ndim == start.ndim == dur.ndim == block.ndim == 1
                and len(types) == len(start) == len(dur) == len(block)):
            raise ValueError("types, start_ns, dur_ns and blocking differ in length")
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
            if self.state != "locked":
                j = min(j, i + max(1, self._try_at - self._seen))
            out += self._feed(types[i:j], start[i:j], start[i:j] + dur[i:j], block[i:j])
            i = j
        return out

    def _feed(self, types, start, end, block) -> list:
        prev = self._last_call_start if self._last_call_start is not None else start[0]
        gap = np.diff(start, prepend=prev)
        self._last_call_start = int(start[-1])
        self._types = np.concatenate([self._types, types])
        self._start = np.concatenate([self._start, start])
        self._end = np.concatenate([self._end, end])
        self._block = np.concatenate([self._block, block])
        self._gap = np.concatenate([self._gap, gap])
        self._seen += len(types)
        out: list = []
        if self.state == "locked":
            out += self._match()
        if self.state != "locked" and self._seen >= self._try_at:
            change = self._estimate()
            if change:
                out.append(change)
                out += self._match()
        self._trim()
        return out

    def _n_since_anchor(self) -> int:
        base = self._last_anchor if self._last_anchor is not None else self._offset
        return self._offset + len(self._types) - base

    def _tokens(self, lo: int, hi: int) -> np.ndarray:
        t = self._types[lo:hi]
        if self._gap_thr is None:
            return t
        return t * 2 + (self._gap[lo:hi] > self._gap_thr)

    # -- period and anchor -----------------------------------------------------------

    def _estimate(self) -> PatternChange | None:
        # Estimate on the calls since the last anchor (a new pattern), at most a window.
        lo = max(0, len(self._types) - self.window)
        if self._last_anchor is not None:
            lo = max(lo, self._last_anchor - self._offset)
        n = len(self._types) - lo
        nlags = min(self.max_period, n // self.min_repeats)
        if nlags < self.min_period:
            self._try_at = self._seen + self.min_calls
            return None
        best = None
        for use_gaps in (False, True):
            thr = _otsu_threshold(self._gap[lo:]) if use_gaps else None
            if use_gaps and thr is None:
                continue
            self._gap_thr = thr
            toks = self._tokens(lo, len(self._types))
            found = self._period_and_anchor(toks, self._gap[lo:], nlags)
            self._gap_thr = None
            if found and (best is None or found[2] > best[2]):
                best = (*found, thr)
            if best and best[2] >= 0.8:
                break
        # Let the window grow before trying again.
        self._try_at = self._seen + max(self.min_calls, n // 4)
        if best is None:
            return None
        period, phase, score, peak, thr = best     # phase: index into the window
        self._gap_thr = thr
        toks = self._tokens(lo, len(self._types))
        kk = _anchor_length(period, int(toks.max()) + 1, self.anchor_k)
        self._anchor = toks[phase:phase + kk].copy()
        previous = self.period
        self.period = period
        self.state = "locked"
        self._irregular = 0
        self._scanned = self._offset + lo
        self._last_anchor = None
        self._prev_end = None
        return PatternChange(self.rank, period, previous,
                             "locked" if previous is None else "changed",
                             int(self._start[-1]), peak, score, thr is not None)

    def _period_and_anchor(self, toks: np.ndarray, gaps: np.ndarray, nlags: int):
        n = len(toks)
        ntypes = int(toks.max()) + 1
        r = _kernels.categorical_acf(toks, ntypes, nlags)
        if not np.isfinite(r[1:]).any():
            return None
        lags = np.arange(nlags + 1)
        adj = r * n / np.maximum(n - lags, 1)      # undo the 1/n shrinkage at long lags
        # Indels smear a long period's peak over neighbouring lags.
        width = np.maximum(1, np.ceil(0.02 * lags)).astype(int)
        sm = np.array([adj[max(0, k - w):k + w + 1].max() for k, w in zip(lags, width)])
        cand = sm[self.min_period:]
        top = float(cand.max())
        # The ACF of an unrelated sequence at one lag is ~N(0, 1/n): over a
        # few hundred lags a chance peak of 3/sqrt(n) is expected.
        if top < max(self.min_peak, 4.0 / math.sqrt(n)):
            return None
        for k in range(self.min_period, nlags + 1):
            if sm[k] < self.peak_fraction * top:
                continue
            k_best = int(np.argmax(adj[max(self.min_period, k - width[k]):k + width[k] + 1])) \
                + max(self.min_period, k - width[k])
            kk = _anchor_length(k_best, ntypes, self.anchor_k)
            if n < self.min_repeats * k_best + kk:
                return None
            scores, lead = _kernels.score_anchors(toks, gaps, k_best, kk, self.tolerance,
                                                  self.min_repeats - 1)
            ok = scores >= max(self.min_anchor_score, 0.8 * scores.max())
            if not ok.any():
                return None
            ph = int(np.argmax(np.where(ok, lead, -1)))
            base = max(n - 2 * k_best - kk, 0)
            return k_best, base + ph, float(scores[ph]), float(adj[k_best])
        return None

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
                self.index += 1
                self._irregular = 0
            else:
                m = max(1, round(gap / P))
                self.index += m
                self.skipped += m
                self._irregular += gap > P * (1 + self.tolerance)
            self._prev_end = end
            self._last_anchor = g_abs
        if self._irregular >= 5 or self._n_since_anchor() > self.relock_after * P + k:
            self.state = "relocking"
            self._try_at = self._seen
            if self._irregular >= 5:
                self._last_anchor = self._offset + len(self._types) - 1
            self._irregular = 0
        return out

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
        return IterationRecord(self.rank, self.index, start, dur, b - a, comm, dur - comm)

    def _trim(self) -> None:
        keep_from = len(self._types) - self.window
        if self._last_anchor is not None:
            keep_from = min(keep_from, self._last_anchor - self._offset - (self.period or 0))
        keep_from = min(keep_from, self._scanned - self._offset - self.anchor_k)
        if keep_from > 0:
            for name in ("_types", "_start", "_end", "_block", "_gap"):
                setattr(self, name, getattr(self, name)[keep_from:])
            self._offset += keep_from


def _anchor_length(period: int, ntypes: int, minimum: int) -> int:
    """Calls in the anchor: enough that a chance repeat of it inside one
    period is unlikely (ntypes^k >> period^2), no more than the period."""
    need = math.ceil(2 * math.log(period + 1) / math.log(max(ntypes, 2))) + 1
    return int(min(period, max(minimum, need)))


def _otsu_threshold(gaps: np.ndarray) -> int | None:
    """The host-gap length that best splits short gaps (between calls of one
    phase) from long ones (compute), by Otsu's method on log gaps."""
    g = gaps[gaps > 0]
    if len(g) < 8:
        return None
    lg = np.log(g.astype(np.float64))
    hist, edges = np.histogram(lg, bins=64)
    if hist.sum() == 0:
        return None
    w = hist / hist.sum()
    mids = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(w)
    m0 = np.cumsum(w * mids)
    mt = m0[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (mt * w0 - m0) ** 2 / (w0 * (1 - w0))
    between[~np.isfinite(between)] = -1
    i = int(np.argmax(between))
    if between[i] <= 0:
        return None
    return int(math.exp(edges[i + 1]))


def warm_up() -> float:
    """Compile (or load from the on-disk cache) every Numba kernel on tiny
    inputs; returns the seconds it took. scripts/setup runs it once, so the
    first `attach` does not compile on the CPUs the job is using."""
    import time
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    _kernels.acf(rng.normal(size=16), 4)
    changepoints(rng.normal(size=32))
    est = IterationEstimator(window=64, max_period=16, min_calls=8)
    pattern = np.tile(np.arange(4), 16)
    est.feed(pattern, np.arange(64) * 1000, np.full(64, 10))
    _kernels.level_shift(rng.normal(size=8), rng.normal(size=3), 0.1, 4.5, 0.1)
    b = BOCD()
    b.update(0.5)
    b.probability_run_at_most(1)
    return time.perf_counter() - t0
