"""S3: pipeline re-split (exact DP against brute force) and link re-mapping."""
import itertools

import numpy as np
import pytest

from mitigation.resplit import ResplitError, gpipe_ms, predict_split, resplit, split_times
from mitigation.rebalance import solve


def brute(stage_times, current, costs, fixed=None):
    L, S = sum(current), len(current)
    fixed = fixed if fixed is not None else [0.0] * S
    pre = np.concatenate([[0], np.cumsum(costs)])
    b = np.concatenate([[0], np.cumsum(current)])
    speed = [(pre[b[k + 1]] - pre[b[k]]) / stage_times[k] for k in range(S)]
    best = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        m = max((pre[edges[k + 1]] - pre[edges[k]]) / speed[k] + fixed[k] for k in range(S))
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
    fixed = rng.uniform(0, 2, S) if seed % 3 else None
    r = resplit(times, current, None if seed % 2 == 0 else costs, fixed=fixed)
    assert sum(r.split) == L and min(r.split) >= 1 and len(r.split) == S
    assert r.makespan == pytest.approx(brute(times, list(current), costs, fixed), rel=1e-12)


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


def simulate_gpipe(stage_ms, m: int, fwd: float = 1 / 3) -> float:
    """The span of pipeline_train.py's schedule, event by event: each stage
    runs every micro-batch forward (after the stage before it sent it), then
    every one backward (after the stage after it sent its gradient)."""
    S = len(stage_ms)
    f = [t / m * fwd for t in stage_ms]
    b = [t / m * (1 - fwd) for t in stage_ms]
    done_f = [[0.0] * m for _ in range(S)]
    for k in range(S):
        for i in range(m):
            ready = max(done_f[k][i - 1] if i else 0.0, done_f[k - 1][i] if k else 0.0)
            done_f[k][i] = ready + f[k]
    done_b = [[0.0] * m for _ in range(S)]
    for k in reversed(range(S)):
        for i in range(m):
            ready = max(done_b[k][i - 1] if i else done_f[k][m - 1],
                        done_b[k + 1][i] if k < S - 1 else 0.0)
            done_b[k][i] = ready + b[k]
    return max(done_b[k][m - 1] for k in range(S))


@pytest.mark.parametrize("seed", range(20))
def test_the_gpipe_span_matches_the_schedule_simulated(seed):
    rng = np.random.default_rng(seed)
    S, m = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    t = rng.uniform(1.0, 20.0, S).tolist()
    assert gpipe_ms(t, m) == pytest.approx(simulate_gpipe(t, m, rng.uniform(0.2, 0.6)))
    assert gpipe_ms(t, None) == max(t)


def test_a_split_is_predicted_from_the_stages_speeds():
    # Stage 1 runs at a quarter of stage 0's speed; 4 micro-batches.
    assert split_times([10.0, 40.0], [4, 4], [7, 1]) == pytest.approx([17.5, 10.0])
    now = gpipe_ms([10.0, 40.0], 4)                   # 10/4 + 4 * 40/4 = 42.5
    new = gpipe_ms([17.5, 10.0], 4)                   # 17.5 + 10/4 = 20.0
    assert (now, new) == (42.5, 20.0)
    # The rest of the iteration (sends, all-reduce) scales with the span.
    assert predict_split([10.0, 40.0], [4, 4], [7, 1], 85.0, 4) == pytest.approx(40.0)
    assert predict_split([10.0, 40.0], [4, 4], [4, 4], 60.0, 4) == pytest.approx(60.0)


def test_a_stages_fixed_time_stays_where_it_is():
    # Stage 1 is 4x slow at compute, and spends 30 ms per step in its sends
    # whatever it holds. Moving layers off it cannot move those: the best
    # split weighs them, and the prediction keeps them.
    r = resplit([10.0, 40.0], [4, 4], fixed=[7.5, 30.0])
    assert r.current_makespan == 70.0
    assert list(r.split) == [7, 1] and r.makespan == pytest.approx(max(17.5 + 7.5, 10 + 30))
    # The iteration the schedule would run, simulated with each stage's time
    # (its layers' and its fixed part) spread over its micro-batches: the
    # prediction from the split in force matches it; scaling every part
    # with the compute alone (the fixed part left out) predicts it 24% low.
    now = simulate_gpipe([10.0 + 7.5, 40.0 + 30.0], 4)
    new = simulate_gpipe([17.5 + 7.5, 10.0 + 30.0], 4)
    got = predict_split([10.0, 40.0], [4, 4], [7, 1], now, 4, fixed=[7.5, 30.0])
    assert got == pytest.approx(new)
    assert predict_split([10.0, 40.0], [4, 4], [7, 1], now, 4) < 0.8 * new
    with pytest.raises(ResplitError):
        resplit([1.0, 1.0], [2, 2], fixed=[1.0, -1.0])


def test_the_stages_times_come_from_their_slowest_replicas_calls():
    # 2 stages x 2 replicas; rank 1 (stage 1) throttled: 40 ms of compute
    # over its 4 layers, 8 in its gradients' all-reduce, 30 in its sends
    # and receives. The others compute 10 ms and wait the rest of the 80 ms
    # step: stage 0 in its receives (the p2p), rank 3 in the all-reduce.
    from collections import deque

    from mitigation.episode import Rank
    from mitigation.restart import stage_times

    def rank(compute, p2p, dur=80.0):
        return Rank(*(deque(x) for x in (list(range(20)), [dur] * 20, [compute] * 20,
                                                [None] * 20, [p2p] * 20)))
    ranks = {0: rank(10.0, 68.0), 1: rank(40.0, 30.0, 78.0), 2: rank(10.0, 67.0),
             3: rank(10.0, 2.0)}
    announced = {r: {"rank": r, "stage": r % 2} for r in ranks}
    grows, fixed, compute = stage_times(announced, ranks, [4, 4])
    assert compute == [10.0, 40.0]
    # Rank 1's own: its compute and all-reduce grow with its layers, its
    # sends do not. Stage 0's calls are mostly its waits for stage 1: its
    # own are the same calls at its own (4x) speed.
    assert grows == pytest.approx([10.0 + 8.0 / 4, 48.0])
    assert fixed == pytest.approx([30.0 / 4, 30.0])
    # Without p2p times (NCCL's sends are not waited in) nothing is fixed.
    for r in ranks.values():
        r.p2p_ms.clear()
    grows, fixed, _ = stage_times(announced, ranks, [4, 4])
    assert fixed == [0.0, 0.0] and grows[1] == pytest.approx(78.0)
