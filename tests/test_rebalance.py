"""S2 micro-batch rebalancing: the cvxpy/HiGHS integer program against exact
brute force on small cases, and its constraints."""
import itertools

import numpy as np
import pytest

from mitigation.rebalance import RebalanceError, even_split, greedy, solve


def brute_force(t, total, caps=None, fixed=None):
    w = len(t)
    caps = caps or [total] * w
    fixed = fixed or [0.0] * w
    best = None
    for counts in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(counts) != total:
            continue
        m = max(f + c * x for f, c, x in zip(fixed, counts, t))
        if best is None or m < best - 1e-12:
            best = m
    return best


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    w = int(rng.integers(2, 5))
    total = int(rng.integers(w, 13))
    t = rng.uniform(0.5, 3.0, size=w).round(3)
    caps = None if seed % 3 else [int(c) for c in rng.integers(1, total, size=w)]
    if caps and sum(caps) < total:
        caps[0] += total - sum(caps)
    r = solve(t, total, caps)
    assert sum(r.counts) == total and min(r.counts) >= 1
    if caps:
        assert all(c <= k for c, k in zip(r.counts, caps))
    best = brute_force(list(t), total, caps)
    assert r.makespan == pytest.approx(best, rel=1e-9)
    assert r.status == "optimal"          # the MIP certified it, not the fallback
    g = greedy(t, total, caps)
    assert sum(g) == total and max(g * t) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_fixed_times_per_iteration_match_brute_force(seed):
    # A rank's fixed time per iteration (its step, its collectives' CPU)
    # does not shrink with its micro-batches: the optimum counts it.
    rng = np.random.default_rng(100 + seed)
    w = int(rng.integers(2, 5))
    total = int(rng.integers(w, 13))
    t = rng.uniform(0.5, 3.0, size=w).round(3)
    f = rng.uniform(0.0, 6.0, size=w).round(3)
    r = solve(t, total, fixed=list(f))
    best = brute_force(list(t), total, fixed=list(f))
    assert r.makespan == pytest.approx(best, rel=1e-9) and r.status == "optimal"
    g = greedy(t, total, fixed=f)
    assert max(f + g * t) == pytest.approx(best, rel=1e-9)
    # Two ranks alike but for rank 1's fixed 4 ms: it takes 3 of 10, not 5.
    assert solve([1.0, 1.0], 10, fixed=[0.0, 4.0]).counts == (7, 3)
    with pytest.raises(RebalanceError):
        solve([1.0, 1.0], 4, fixed=[0.0, -1.0])


def test_large_case_is_certified_optimal():
    rng = np.random.default_rng(7)
    t = rng.uniform(1, 2, 512)
    r = solve(t, 8 * 512)
    assert r.status == "optimal" and sum(r.counts) == 8 * 512
    # No single move of one micro-batch from the slowest rank helps: a local
    # optimality check independent of both solvers.
    c = np.array(r.counts)
    worst = int(np.argmax(c * t))
    best_target = np.min((c + 1) * t)
    assert best_target >= r.makespan - 1e-9 or c[worst] == 1


def test_slow_rank_gets_fewer_microbatches():
    # 4 ranks, 32 micro-batches, rank 2 twice as slow: even split takes 16 units.
    r = solve([1.0, 1.0, 2.0, 1.0], 32)
    assert r.counts[2] < 8 and r.even_makespan == 16.0
    assert r.makespan == pytest.approx(10.0) and r.speedup == pytest.approx(1.6)


def test_bad_input():
    with pytest.raises(RebalanceError):
        solve([1.0, 0.0], 4)
    with pytest.raises(RebalanceError):
        solve([1.0, 1.0, 1.0], 2)
    with pytest.raises(RebalanceError):
        solve([1.0, 1.0], 10, caps=[3, 3])
    assert even_split(10, 4) == [3, 3, 2, 2]
