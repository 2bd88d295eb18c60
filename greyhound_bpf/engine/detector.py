"""Slowdown detection on iteration times: log, a running median of 3, and a
BOCD over the result; a new level is reported once it is likely, significant
and at least `threshold` in size (`SlowdownDetector.update(x) -> ChangePoint
| None`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _kernels
from .bocd import BOCD, DEFAULT_HAZARD, RunLengthSummary, level_shift_prior

# A slowdown is reported when iterations get at least this much slower: the
# fail-slow faults worth acting on cost 10-60% (DESIGN.md); smaller level
# changes are within what a shared host's scheduling moves a job by.
SLOWDOWN_THRESHOLD = 0.10
# ...and the BOCD's posterior mass of a change within the new segment is at
# least this: a clear level change reaches 0.99 within a few iterations.
MIN_PROBABILITY = 0.9


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
    baseline_at: int = -1  # observation index where the window of before_ms begins

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

    A slower new level is a ``slowdown``, a faster one while slow a
    ``recovery``; a speed-up is never a slowdown. A faster level while
    nothing is slow is no event: it becomes the reference, and for `history`
    iterations a slower level after it is a slowdown only if it is also
    slower than the level before the speed-up.

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

    def __init__(self, *, scope: str = "job", threshold: float = SLOWDOWN_THRESHOLD,
                 min_probability: float = MIN_PROBABILITY, min_z: float = 4.5,
                 hazard: float = DEFAULT_HAZARD,
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
        # (log level, until) before a faster level taken while healthy
        self._before_fast: tuple[float, int] | None = None
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
            p = level_shift_prior(base)
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
            self._before_fast = None
            if self.state == "ok":
                if self._healthy is not None and math.log(cp.after_ms) < self._healthy:
                    # Back, and faster than before the slowdown: as for a
                    # speed-up while healthy, the usual speed after this is
                    # no new slowdown.
                    self._before_fast = (self._healthy, cp.index + self.history)
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
        if self.state != "slow" and self._before_fast is not None \
                and start >= self._before_fast[1]:
            self._before_fast = None             # the faster level has lasted
        if code < 0 and self.state != "slow":
            # Faster while nothing is slow: no recovery, but the reference
            # from now on (a job faster once warmed up must be compared with
            # its faster self). The level before it is remembered for a while.
            if self._before_fast is None:
                self._before_fast = (m_old, start + self.history)
            self._accepted_start = start
            return None
        if code > 0 and self.state != "slow" and self._before_fast is not None \
                and m_new < self._before_fast[0] + math.log1p(self.threshold):
            # ...because a busy host's job also runs fast for a moment (a
            # neighbour paused): its usual speed after that is no slowdown
            # (a healthy 4-rank job: 0.4 s at x0.7, then "x1.5 slower",
            # its own log as steady as before).
            self._accepted_start, self._before_fast = start, None
            return None
        kind = "slowdown" if code > 0 else "recovery"
        return ChangePoint(kind, self.scope, start, t, math.exp(m_old), math.exp(m_new),
                           math.exp(m_new - m_old), prob, old_lo)

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
        slow_lo = max(self._accepted_start, self._base)
        slow = self._logs[slow_lo - self._base:lo - self._base]
        m_old = float(np.median(slow))
        if m_old <= m_new:
            return None
        # Where the faster level began: the BOCD's segment start when it
        # lies in the slow stretch, else the start of the window.
        start = max(s.segment_start - 1, self._base)
        start = start if self._accepted_start < start <= lo else lo
        return ChangePoint("recovery", self.scope, start, t, math.exp(m_old), math.exp(m_new),
                           math.exp(m_new - m_old), self._bocd.probability_run_at_most(t - start + 1),
                           slow_lo)

    def _filtered(self, i: int) -> float:
        j = i - self._base
        w = sorted(self._logs[max(0, j - 2):j + 1].tolist())
        return w[len(w) // 2]
