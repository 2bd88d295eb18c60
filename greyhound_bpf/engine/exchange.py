"""A rank locked on a repeated point-to-point exchange, and a collective
comes: is the exchange a pipeline stage's micro-batch (the step is longer:
estimated again) or a whole step of data-parallel peers that exchange
with their neighbours (decentralized SGD: the collective is a logged loss
now and then)? One rank's calls cannot always tell (a 1F1B middle stage
sends and receives in strict turn through its whole step, its step's
collective the only mark), so the lock is kept only where both hold:

- the exchange runs on whole across every collective (`breaks`): a
  pipeline's first stage sends its warm-up forwards' activations without
  receiving and receives its cool-down backwards' gradients without
  sending, right next to its step's collective (tests/scenarios/
  healthy-pipe*-m16, whose stages otherwise all agreed on 2 calls);
- every other rank of the job repeats the same exchange (`peers_say`).
"""
from __future__ import annotations

import numpy as np


def breaks(types: np.ndarray, coll: np.ndarray, lo: int, period: int
           ) -> tuple[bool | None, int, bool]:
    """Judges the collectives at buffer index `lo` on: whether the period
    of calls before one (collectives left out) differs from the period
    after it (fewer where fewer came before: right after an attach; none:
    taken as whole for now, the next collective is judged too). Returns
    (True if one breaks it, None while the calls after one are not in yet,
    else False; the index up to which collectives were judged; whether
    one was judged whole)."""
    colls = np.flatnonzero(coll[lo:]) + lo
    if len(colls) == 0:
        return False, lo, False     # a kept lock's every batch: nothing to judge
    other = np.flatnonzero(~coll)
    whole = False
    for c in colls.tolist():
        k = int(np.searchsorted(other, c))
        if len(other) - k < period:
            return None, lo, whole
        lo = c + 1
        j = min(k, period)
        if not np.array_equal(types[other[k - j:k]], types[other[k - j + period:k + period]]):
            return True, lo, whole
        whole = True
    return False, lo, whole


def peers_say(peers: list[int | None], period: int) -> bool | None:
    """Whether the collective is a pipeline step's, by the other ranks'
    `rhythm`: True alone or where another rank is locked otherwise, False
    where every other rank repeats this exchange, None while one is
    undecided."""
    if not peers:
        return True
    if any(r is None for r in peers):
        return None
    return not all(r == period for r in peers)
