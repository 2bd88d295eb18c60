"""Helpers of the iteration estimator's period search (iterations.py): how
long an anchor must be, which host gaps are long, and what a search found."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


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
