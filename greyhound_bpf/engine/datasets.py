"""Seeded synthetic data with known truth, for tests and scripts/bench_*.

``call_stream`` makes one rank's probed-call stream (call types, start
times, durations, blocking flags) with its true iteration boundaries;
``iteration_series`` makes an iteration-time series with its true change
points. ``precision_recall`` scores detected change points against the truth
with a margin, as change-point benchmarks do.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CallStream:
    types: np.ndarray       # int64 call-type id (function x communicator)
    start_ns: np.ndarray    # int64
    dur_ns: np.ndarray      # int64
    blocking: np.ndarray    # bool: the host waits in this call
    iter_start_ns: np.ndarray   # true start of every iteration
    iter_dur_ns: np.ndarray     # true duration of every iteration
    period: int                 # calls per regular iteration
    change_points: list[int] = field(default_factory=list)  # iteration indices


def call_stream(period: int = 20, n_iter: int = 200, *, ntypes: int = 6, n_comms: int = 1,
                noise: float = 0.0, iter_ms: float = 100.0, cv: float = 0.02,
                slowdowns: tuple[tuple[int, float], ...] = (), eval_every: int = 0,
                eval_calls: int = 7, restart_at: int | None = None, seed: int = 0,
                t0_ns: int = 1_700_000_000_000_000_000) -> CallStream:
    """A training loop's calls: each iteration repeats one pattern of `period`
    calls (types drawn from ntypes functions x n_comms communicators), after
    a compute phase that takes 40% of the iteration.

    noise: fraction of calls inserted (a random extra call) or dropped, half
      each. slowdowns: (iteration, factor) pairs; the factor applies from
      that iteration on. eval_every: every N-th iteration adds an evaluation
      block of eval_calls extra calls and 30% more time. restart_at: from this
      iteration on, a new random pattern (a restarted job).
    """
    rng = np.random.default_rng(seed)
    nkinds = ntypes * n_comms

    def make_pattern():
        p = rng.integers(0, nkinds, size=period)
        return p

    pattern = make_pattern()
    eval_block = rng.integers(0, nkinds, size=eval_calls) + nkinds
    types, starts, durs, blocks = [], [], [], []
    it_start, it_dur = [], []
    t = float(t0_ns)
    factor = 1.0
    slow = dict(slowdowns)
    for i in range(n_iter):
        if i in slow:
            factor = slow[i]
        if restart_at is not None and i == restart_at:
            pattern = make_pattern()
        dur = iter_ms * 1e6 * factor * max(0.2, 1.0 + cv * rng.standard_normal())
        calls = list(pattern)
        is_eval = bool(eval_every) and i > 0 and i % eval_every == 0
        if is_eval:
            dur *= 1.3
            calls += list(eval_block)
        it_start.append(int(t))
        it_dur.append(int(dur))
        # Compute first, then the calls spread over the remaining 60%.
        slot = 0.6 * dur / len(calls)
        ct = t + 0.4 * dur
        for c in calls:
            r = rng.random()
            if r < noise / 2:                      # dropped
                ct += slot
                continue
            d = slot * 0.5
            types.append(int(c))
            starts.append(int(ct))
            durs.append(int(d))
            blocks.append(True)
            if r > 1.0 - noise / 2:                # an extra call inserted
                types.append(int(rng.integers(0, nkinds)))
                starts.append(int(ct + d + 1))
                durs.append(int(slot * 0.1))
                blocks.append(True)
            ct += slot
        t += dur
    return CallStream(np.array(types, dtype=np.int64), np.array(starts, dtype=np.int64),
                      np.array(durs, dtype=np.int64), np.array(blocks, dtype=bool),
                      np.array(it_start, dtype=np.int64), np.array(it_dur, dtype=np.int64),
                      period, [i for i, _ in slowdowns])


def iteration_series(n: int = 500, *, changes: tuple[tuple[int, float], ...] = (),
                     base_ms: float = 100.0, cv: float = 0.05, spike_prob: float = 0.0,
                     spike_factor: float = 3.0, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Iteration times (ms) with multiplicative level changes at the given
    indices, Gaussian noise of coefficient of variation cv, and optional
    one-iteration spikes (a GC pause) of spike_factor with probability
    spike_prob. Returns (series, true change points)."""
    rng = np.random.default_rng(seed)
    level = np.full(n, base_ms)
    for idx, f in sorted(changes):
        level[idx:] = base_ms * f
    x = level * (1.0 + cv * rng.standard_normal(n))
    if spike_prob:
        spikes = rng.random(n) < spike_prob
        x[spikes] *= spike_factor
    return np.maximum(x, base_ms * 0.05), [i for i, _ in sorted(changes)]


def precision_recall(truth: list[int], found: list[int], margin: int = 5
                     ) -> tuple[float, float, float]:
    """Precision, recall and F1 of found change points: a found point is a
    true positive if it lies within `margin` of a true one not matched yet."""
    unmatched = sorted(truth)
    tp = 0
    for f in sorted(found):
        hit = next((t for t in unmatched if abs(t - f) <= margin), None)
        if hit is not None:
            unmatched.remove(hit)
            tp += 1
    precision = tp / len(found) if found else 1.0
    recall = tp / len(truth) if truth else 1.0
    f1 = 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)
    return precision, recall, f1
