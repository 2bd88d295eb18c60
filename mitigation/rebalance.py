"""S2: rebalance micro-batches across data-parallel ranks.

Choose integer counts n_i >= 1 with sum n_i = M (the global batch is kept)
that minimise the iteration time, the makespan max_i f_i + n_i * t_i, where
t_i is rank i's measured time per micro-batch and f_i its fixed time per
iteration (0 unless measured at two splits); optional per-rank caps
n_i <= cap_i (memory). Solved as a mixed-integer program with cvxpy and
HiGHS (no extra solver package needed).

Left alone, HiGHS needs seconds to close the gap at a few hundred ranks
(its LP relaxation bound M / sum(1/t_i) is weak). So the program is handed
what a greedy water-filling already knows: the greedy split's makespan is
an upper bound on T, and it bounds every n_i by floor(T_greedy / t_i). The
greedy (give each next micro-batch to the rank that would finish it first)
is itself optimal for this objective; the MIP certifies it and is where
further constraints go. `scripts/bench_rebalance` times both.
"""
from __future__ import annotations

import heapq
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from .control import even_split  # noqa: F401  (re-exported: the policy's and tests' import)


class RebalanceError(ValueError):
    pass


@dataclass(frozen=True)
class Rebalance:
    counts: tuple[int, ...]       # micro-batches per data-parallel rank
    makespan: float               # predicted iteration time, in the unit of t
    even_makespan: float          # the same with the even split (what runs now)
    solve_s: float                # solver wall time
    status: str = "optimal"       # the MIP's status ("greedy" when it gave no answer)

    @property
    def speedup(self) -> float:
        return self.even_makespan / self.makespan


def _check(per_microbatch, total: int, caps) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(per_microbatch, dtype=np.float64)
    w = len(t)
    if w == 0 or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise RebalanceError("per-micro-batch times must be positive and finite")
    if total < w:
        raise RebalanceError(f"{total} micro-batches cannot give each of {w} ranks one")
    cap = np.full(w, total, dtype=np.int64) if caps is None else np.asarray(caps, dtype=np.int64)
    if len(cap) != w or np.any(cap < 1) or cap.sum() < total:
        raise RebalanceError("caps must be >= 1 per rank and hold the global batch together")
    return t, np.minimum(cap, total)


def _fixed(fixed, w: int) -> np.ndarray:
    f = np.zeros(w) if fixed is None else np.asarray(fixed, dtype=np.float64)
    if len(f) != w or not np.all(np.isfinite(f)) or np.any(f < 0):
        raise RebalanceError("fixed times must be one per rank, >= 0 and finite")
    return f


def greedy(per_microbatch, total: int, caps=None, fixed=None) -> np.ndarray:
    """Optimal counts by water-filling: O(M log W). (Each rank's time grows
    by the same t_i with every micro-batch, so giving the next one to the
    rank that would finish it first is optimal, fixed times or not.)"""
    t, cap = _check(per_microbatch, total, caps)
    f = _fixed(fixed, len(t))
    n = np.ones(len(t), dtype=np.int64)
    heap = [(f[i] + 2 * t[i], i) for i in range(len(t)) if cap[i] > 1]
    heapq.heapify(heap)
    for _ in range(total - len(t)):
        _, i = heapq.heappop(heap)
        n[i] += 1
        if n[i] < cap[i]:
            heapq.heappush(heap, (f[i] + (n[i] + 1) * t[i], i))
    return n


def greedy_makespan(per_microbatch, total: int, caps=None) -> float:
    """The optimal makespan (from the greedy split), without the MIP."""
    t = np.asarray(per_microbatch, dtype=np.float64)
    return float((greedy(t, total, caps) * t).max())


_banner_gone = False


def _quiet_highs() -> None:
    """HiGHS 1.16 prints a banner on stdout when a process makes its first
    solver, whatever its options; greyhound's stdout may be JSON lines
    (`replay`, `attach -j`). The first one is made here, with the
    process's stdout pointed at /dev/null; later ones say nothing."""
    global _banner_gone
    if _banner_gone:
        return
    _banner_gone = True
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def warm(clock=time.monotonic_ns) -> tuple[int, int]:
    """Import the solver and solve once (cvxpy's import and its first
    problem: about 0.5 CPU s), so that the first plan, which a job waits
    for, does not pay for them (`attach` does it while it starts, at idle
    priority). Returns its (start, end) on `clock`."""
    start = clock()
    solve([1.0, 2.0], 3)
    return start, clock()


def solve(per_microbatch: list[float] | np.ndarray, total: int,
          caps: list[int] | None = None, time_limit: float = 10.0,
          fixed: list[float] | None = None) -> Rebalance:
    """Minimise max_i f_i + n_i t_i subject to sum n_i = total,
    1 <= n_i <= cap_i (`fixed`: f_i, default 0)."""
    import cvxpy as cp
    _quiet_highs()
    t, cap = _check(per_microbatch, total, caps)
    w = len(t)
    f = _fixed(fixed, w)
    start = time.perf_counter()
    # Scale times to O(1): the solver's tolerances are absolute.
    scale = float(t.max())
    ts, fs = t / scale, f / scale
    g = greedy(ts, total, cap, fs)
    t_greedy = float((fs + g * ts).max())
    upper = np.minimum(cap, np.floor((t_greedy - fs) / ts * (1 + 1e-9))).astype(np.int64)
    upper = np.maximum(upper, 1)
    lower = np.maximum(1, total - (upper.sum() - upper))
    n = cp.Variable(w, integer=True)
    T = cp.Variable()
    prob = cp.Problem(cp.Minimize(T), [fs + cp.multiply(ts, n) <= T, cp.sum(n) == total,
                                       n >= lower, n <= upper, T <= t_greedy])
    try:
        prob.solve(solver=cp.HIGHS, time_limit=time_limit)
        status = prob.status
    except cp.error.SolverError as e:
        status = f"solver error: {e}"
    counts = g
    if n.value is not None and status == cp.OPTIMAL:
        mip = np.rint(n.value).astype(np.int64)
        # The MIP's counts only where they are strictly better: an optimum
        # held by one rank (a straggler at its least) leaves the others
        # any counts under it, and the greedy's are the balanced ones.
        if (mip.sum() == total and np.all(mip >= 1) and np.all(mip <= cap)
                and (fs + mip * ts).max() < t_greedy * (1 - 1e-9)):
            counts = mip
    else:
        status = "greedy"
    elapsed = time.perf_counter() - start
    even = np.array(even_split(total, w))
    return Rebalance(tuple(int(c) for c in counts), float((f + counts * t).max()),
                     float((f + even * t).max()), elapsed, status)
