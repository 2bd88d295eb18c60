"""Helpers of the iteration estimator's period search (iterations.py): how
long an anchor must be, and which host gaps are long."""
from __future__ import annotations

import math

import numpy as np


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
