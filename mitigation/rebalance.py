"""S2: rebalance micro-batches across data-parallel ranks.

Choose integer counts n_i >= 1 with sum n_i = M (the global batch is kept)
that minimise the iteration time, the makespan max_i n_i * t_i, where t_i
is rank i's measured time per micro-batch; optional per-rank caps
n_i <= cap_i (memory). Solved as a mixed-integer program with cvxpy and
HiGHS (no extra solver package needed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


class RebalanceError(ValueError):
    pass


@dataclass(frozen=True)
class Rebalance:
    counts: tuple[int, ...]       # micro-batches per data-parallel rank
    makespan: float               # predicted iteration time, in the unit of t
    even_makespan: float          # the same with the even split (what runs now)
    solve_s: float                # solver wall time

    @property
    def speedup(self) -> float:
        return self.even_makespan / self.makespan


def even_split(total: int, ranks: int) -> list[int]:
    base, extra = divmod(total, ranks)
    return [base + (1 if i < extra else 0) for i in range(ranks)]


def solve(per_microbatch: list[float] | np.ndarray, total: int,
          caps: list[int] | None = None, time_limit: float = 10.0) -> Rebalance:
    """Minimise max_i n_i t_i subject to sum n_i = total, 1 <= n_i <= cap_i."""
    import cvxpy as cp
    t = np.asarray(per_microbatch, dtype=np.float64)
    w = len(t)
    if w == 0 or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise RebalanceError("per-micro-batch times must be positive and finite")
    if total < w:
        raise RebalanceError(f"{total} micro-batches cannot give each of {w} ranks one")
    cap = np.full(w, total) if caps is None else np.asarray(caps, dtype=np.int64)
    if len(cap) != w or np.any(cap < 1) or cap.sum() < total:
        raise RebalanceError("caps must be >= 1 per rank and hold the global batch together")
    # Scale times to O(1): the solver's tolerances are absolute.
    scale = float(t.max())
    ts = t / scale
    n = cp.Variable(w, integer=True)
    T = cp.Variable()
    prob = cp.Problem(cp.Minimize(T), [cp.multiply(ts, n) <= T, cp.sum(n) == total,
                                       n >= 1, n <= cap])
    start = time.perf_counter()
    prob.solve(solver=cp.HIGHS, time_limit=time_limit)
    elapsed = time.perf_counter() - start
    if n.value is None:
        raise RebalanceError(f"no split found ({prob.status})")
    counts = np.rint(n.value).astype(np.int64)
    even = np.array(even_split(total, w))
    return Rebalance(tuple(int(c) for c in counts), float((counts * t).max()),
                     float((even * t).max()), elapsed)
