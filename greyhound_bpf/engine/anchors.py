"""The iteration estimator's period search (iterations.py): the ACF's
period and its anchor (`PeriodSearch`), how long an anchor must be, which
host gaps are long, and what a search found."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _kernels

# A pipeline stage's point-to-point calls repeat once per micro-batch, and
# its step's collective (the gradients' all-reduce, a global-norm clip) once
# per step. A period of a stage's calls must hold a collective at least
# once in this many periods on average where the window has collectives,
# else it is a micro-batch's (a middle stage of a 1F1B pipeline sends and
# receives in strict turn: period 2, at ACF 0.9, where its step is 25
# calls; examples/pipeline_1f1b.py, held out at first, was missed so).
STEP_COLLECTIVE_EVERY = 2


class Found(NamedTuple):
    """What a period search found (IterationEstimator._search)."""
    period: int
    phase: int              # where its anchor starts, in the calls searched
    score: float            # the anchor's score
    peak: float             # the ACF's peak at the period
    waived: int | bool      # the pipeline rule's first period passed over (0: none)
    thr: int | None         # the host-gap threshold of its gap classes (None: types alone)
    colls: int              # collectives among the calls (a pipeline stage's window)
    nlags: int              # the longest period the search could see
    one: bool               # a period of one: one call type, no phases in its gaps

    @classmethod
    def of_one(cls, calls: int, colls: int, nlags: int) -> "Found":
        """A period of one over `calls` calls (each call an iteration)."""
        return cls(1, calls - 1, 1.0, 1.0, False, None, colls, nlags, True)


def anchor_length(period: int, ntypes: int, minimum: int) -> int:
    """Calls in the anchor: enough that a chance repeat of it inside one
    period is unlikely (ntypes^k >> period^2), no more than the period."""
    need = math.ceil(2 * math.log(period + 1) / math.log(max(ntypes, 2))) + 1
    return int(min(period, max(minimum, need)))


def otsu_threshold(gaps: np.ndarray) -> int | None:
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


class PeriodSearch:
    """The period of a window's call tokens by their ACF, and the anchor
    that marks it: IterationEstimator's, over its settings (min_period,
    peak_fraction, min_peak, anchor_k, min_repeats, tolerance,
    min_anchor_score) and its `_strict` and `_short` flags."""

    def _period_and_anchor(self, toks: np.ndarray, gaps: np.ndarray, nlags: int,
                           colls: int = 0):
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
        waived = 0          # the first period passed over by the pipeline rule
        cand = sm[self.min_period:]
        top = float(cand.max())
        # The ACF of an unrelated sequence at one lag is ~N(0, 1/n): over a
        # few hundred lags a chance peak of 3/sqrt(n) is expected.
        if top < max(self.min_peak, 4.0 / math.sqrt(n)):
            return None
        for k in range(self.min_period, nlags + 1):
            if sm[k] < self.peak_fraction * top:
                continue
            lo = max(self.min_period, int(k - width[k]))
            k_best = int(np.argmax(adj[lo:k + width[k] + 1])) + lo
            if colls and colls * STEP_COLLECTIVE_EVERY * k_best < n:
                waived = waived or k_best
                continue                        # a micro-batch's period, not the step's
            found = self._anchored(toks, gaps, k_best, ntypes, float(adj[k_best]), False)
            if found or not colls or self._short:
                return found                    # (too short: no longer period fits either)
            # A stage's lag that passes the rule but no anchor marks (an even
            # lag of its sends and receives in turn): the step's comes later.
        if waived and not self._strict and colls * STEP_COLLECTIVE_EVERY * nlags < n:
            # No period this window can lock holds its collectives once in
            # STEP_COLLECTIVE_EVERY: too few to tell a step by (one, right
            # after an attach). Locked as if the collective came after the
            # lock: the job's other ranks say whether it is a step's.
            return self._anchored(toks, gaps, waived, ntypes, float(adj[waived]), True)
        return None

    def _anchored(self, toks: np.ndarray, gaps: np.ndarray, period: int, ntypes: int,
                  peak: float, waived: bool):
        kk = anchor_length(period, ntypes, self.anchor_k)
        if len(toks) < self.min_repeats * period + kk:
            self._short = True
            return None
        scores, lead = _kernels.score_anchors(toks, gaps, period, kk, self.tolerance,
                                              self.min_repeats - 1)
        ok = scores >= max(self.min_anchor_score, 0.8 * scores.max())
        if not ok.any():
            return None
        ph = int(np.argmax(np.where(ok, lead, -1)))
        base = max(len(toks) - 2 * period - kk, 0)
        return period, base + ph, float(scores[ph]), peak, waived
