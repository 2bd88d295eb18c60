"""A rank whose calls are all of one type (function, communicator, size):
its period shows only in its host gaps, and a throttled rank's gaps do not
show it as a healthy rank's do. The iteration estimator (iterations.py)
takes such a period only as the job's ranks agree.

- One type and no phases in the gaps: one call per iteration (a small
  model's one DDP bucket, evolution strategies' one all-gather a step),
  after ONE_CALL_MIN_CALLS calls. Provisional: a step of more same-type
  calls than a third of those (PPO's minibatch all-reduces) shows only in
  a longer window, so the calls since are searched again as they grow by
  a quarter, up to the window; only a period that search could not reach
  at the lock is proposed then (a shorter one it passed over, that a
  healthy rank's gaps show later and a throttled one's never do, would
  part the ranks).
- One type and a period in the gaps (a longer one found later, or one at
  the first estimate): proposed, and taken once every other rank offers
  the same (`agree`); until then the rank stays at one (or waits for the
  calls a period of one needs). Ranks of one job make the same collective
  calls, so their periods in calls are equal; a rank whose calls are of
  several types abstains.

Found on examples/topk_compression.py (held out): its values' and
indices' all-gathers are one call type; a healthy rank's gaps showed two
a step and a throttled rank's did not, or the other way round, and the
ranks' iterations no longer compared (already slow at attach: 7 of 10
named within 15 s; a corpus recording named at 33 s). Taken per rank
alone, a period of one after 48 calls cost a job at 4 steps a second 12 s
(examples/evolution_strategies.py, named at 15.0 s).
"""
from __future__ import annotations


def agree(offers: list[int | None] | None, period: int) -> bool:
    """Whether the job's other ranks agree on `period`, by their `offer`
    (IterationEstimator): each offers the same period, or abstains (0: its
    calls are of several types); None (not locked yet) waits. Alone (no
    offers): True."""
    if offers is None:
        return True
    return None not in offers and all(o in (0, period) for o in offers)
