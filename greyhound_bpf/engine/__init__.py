"""The streaming engine: iteration time from the call sequence (ACF), and
online slowdown detection on iteration times (BOCD).

Data flow per rank: call records -> IterationEstimator -> IterationRecord ->
SlowdownDetector -> ChangePoint; JobPipeline runs that for every rank of a
job and one job-level detector, and Topology builds the communicator map.
The classes validate arguments and hold state; the hot loops are Numba
kernels in ._kernels. Everything here takes plain arrays and records, so it
runs the same on live tracer batches, a replayed recording or synthetic data.
"""
from __future__ import annotations

import numpy as np

from . import _kernels
from .bocd import (BOCD, CHANGEPOINTS_HAZARD, DEFAULT_HAZARD, MAX_RUNS, PRUNE_MASS,
                   RunLengthSummary, changepoints, default_prior, map_segment_starts)
from .detector import MIN_PROBABILITY, SLOWDOWN_THRESHOLD, ChangePoint, SlowdownDetector
from .iterations import IterationEstimator, IterationRecord, PatternChange

__all__ = ["BOCD", "CHANGEPOINTS_HAZARD", "DEFAULT_HAZARD", "MAX_RUNS", "MIN_PROBABILITY",
           "PRUNE_MASS", "SLOWDOWN_THRESHOLD", "ChangePoint", "IterationEstimator",
           "IterationRecord", "PatternChange", "RunLengthSummary", "SlowdownDetector",
           "changepoints", "default_prior", "map_segment_starts", "warm_up"]


def warm_up() -> float:
    """Compile (or load from the on-disk cache) every Numba kernel on tiny
    inputs; returns the seconds it took. scripts/setup runs it once, so the
    first `attach` does not compile on the CPUs the job is using."""
    import time
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    _kernels.acf(rng.normal(size=16), 4)
    changepoints(rng.normal(size=32))
    est = IterationEstimator(window=64, max_period=16, min_calls=8)
    pattern = np.tile(np.arange(4), 16)
    est.feed(pattern, np.arange(64) * 1000, np.full(64, 10))
    _kernels.level_shift(rng.normal(size=8), rng.normal(size=3), 0.1, 4.5, 0.1)
    b = BOCD()
    b.update(0.5)
    b.probability_run_at_most(1)
    return time.perf_counter() - t0
