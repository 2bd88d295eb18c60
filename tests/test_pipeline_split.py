"""S3: pipeline re-split (exact DP against brute force) and link re-mapping."""
import itertools

import numpy as np
import pytest

from mitigation.resplit import ResplitError, resplit
from mitigation.rebalance import solve


def brute(stage_times, current, costs):
    L, S = sum(current), len(current)
    pre = np.concatenate([[0], np.cumsum(costs)])
    b = np.concatenate([[0], np.cumsum(current)])
    speed = [(pre[b[k + 1]] - pre[b[k]]) / stage_times[k] for k in range(S)]
    best = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        m = max((pre[edges[k + 1]] - pre[edges[k]]) / speed[k] for k in range(S))
        best = m if best is None else min(best, m)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(2, 5))
    L = int(rng.integers(S, 11))
    current = np.ones(S, dtype=int)
    for i in rng.integers(0, S, L - S):
        current[i] += 1
    times = rng.uniform(0.5, 3, S)
    costs = rng.uniform(0.5, 2, L) if seed % 2 else np.ones(L)
    r = resplit(times, current, None if seed % 2 == 0 else costs)
    assert sum(r.split) == L and min(r.split) >= 1 and len(r.split) == S
    assert r.makespan == pytest.approx(brute(times, list(current), costs), rel=1e-12)


def test_slow_stage_sheds_layers():
    # 4 stages x 8 layers; stage 1 runs at half speed: it keeps fewer layers.
    r = resplit([8.0, 16.0, 8.0, 8.0], [8, 8, 8, 8])
    assert r.split[1] < 8 and sum(r.split) == 32 and r.current_makespan == 16.0
    assert r.speedup > 1.4
    # Equal layers: the same optimum as S2 with per-layer times.
    s2 = solve([1.0, 2.0, 1.0, 1.0], 32)
    assert r.makespan == pytest.approx(s2.makespan)


def test_resplit_bad_input():
    with pytest.raises(ResplitError):
        resplit([1.0, 0.0], [2, 2])
    with pytest.raises(ResplitError):
        resplit([1.0], [2, 2])
    with pytest.raises(ResplitError):
        resplit([1.0, 1.0], [0, 2])
