"""S3: re-split a pipeline's layers across its stages.

``resplit`` gives each pipeline stage a contiguous run of layers (at least
one) so that the slowest stage finishes first: stage k's speed is measured
as the work it holds now over the time it takes (its compute per
iteration), and the new split minimises max_k work(stage k) / speed_k.
Exact, by dynamic programming over layer boundaries (O(S * L^2); 128
stages x 1,000 layers takes well under a second). With equal layers this is
S2's problem and gives the same counts.

A stage's time per step has a part that grows with the layers it holds
(its compute, its gradients' all-reduce) and a part that does not (its
sends and receives, one of each per micro-batch): `fixed`, from the
tracer's time in point-to-point calls (mitigation.restart.stage_times).
The split minimises the slowest stage's sum of the two.

The iteration a split will run is predicted with the GPipe schedule's own
shape: with M micro-batches and p_k = stage k's time per micro-batch, a
step's forward and backward passes take sum(p) + (M - 1) * max(p), the
slowest stage's M micro-batches plus every other stage's one in the fill
and drain (Huang et al., GPipe, 2019). The iteration a split will run is
the iteration now scaled by that span's ratio. Measured on
scripts/pipeline_train.py with one stage under a CPU quota
(`bench_mitigation --pipeline`, every split run for real): holding the
rest of the iteration fixed instead predicted -20% to +100% off; scaling
all of it with the compute, a re-split that moves layers off the slow
stage 15-27% low (its sends do not shrink; README).

The plan goes through the control file and the trainer applies it when it
restarts (S4's checkpoint path).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ResplitError(ValueError):
    pass


@dataclass(frozen=True)
class Resplit:
    split: tuple[int, ...]        # layers per stage, in stage order
    makespan: float               # predicted slowest-stage time
    current_makespan: float       # the same for the split in force

    @property
    def speedup(self) -> float:
        return self.current_makespan / self.makespan


def gpipe_ms(stage_ms, microbatches: int | None) -> float:
    """A GPipe step's compute span from each stage's compute per step
    (without a micro-batch count: the slowest stage's alone)."""
    t = np.asarray(stage_ms, dtype=np.float64)
    if not microbatches or microbatches < 1:
        return float(t.max())
    p = t / microbatches
    return float(p.sum() + (microbatches - 1) * p.max())


def _work(prefix: np.ndarray, split) -> np.ndarray:
    """Each stage's work (summed layer costs) under `split`, from the
    layers' prefix sums."""
    b = np.concatenate([[0], np.cumsum(np.asarray(split, dtype=np.int64))])
    return prefix[b[1:]] - prefix[b[:-1]]


def _prefix(n_layers: int, layer_costs=None) -> np.ndarray:
    costs = np.ones(n_layers) if layer_costs is None else np.asarray(layer_costs, np.float64)
    return np.concatenate([[0.0], np.cumsum(costs)])


def split_times(stage_ms, current_split, new_split, layer_costs=None) -> list[float]:
    """Each stage's compute per step under `new_split`, at the speed it
    showed under `current_split`."""
    prefix = _prefix(int(np.sum(current_split)), layer_costs)
    speed = _work(prefix, current_split) / np.asarray(stage_ms, dtype=np.float64)
    return [float(x) for x in _work(prefix, new_split) / speed]


def predict_split(stage_ms, current_split, new_split, job_ms: float,
                  microbatches: int | None = None, layer_costs=None, fixed=None) -> float:
    """The iteration time `new_split` will run, from the iteration now
    (`job_ms`), the stages' time that grows with their layers under
    `current_split` and the time each spends whatever it holds (`fixed`)."""
    f = np.zeros(len(stage_ms)) if fixed is None else np.asarray(fixed, dtype=np.float64)
    new = np.asarray(split_times(stage_ms, current_split, new_split, layer_costs)) + f
    return job_ms * gpipe_ms(new, microbatches) / gpipe_ms(np.asarray(stage_ms) + f,
                                                            microbatches)


def resplit(stage_times, current_split, layer_costs=None, fixed=None) -> Resplit:
    """stage_times[k]: measured time of stage k with current_split that
    grows with its layers; fixed[k]: its time whatever it holds."""
    t = np.asarray(stage_times, dtype=np.float64)
    f = np.zeros(len(t)) if fixed is None else np.asarray(fixed, dtype=np.float64)
    cur = np.asarray(current_split, dtype=np.int64)
    S = len(t)
    if S == 0 or len(cur) != S:
        raise ResplitError("one measured time per stage, and one layer count per stage")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ResplitError("stage times must be positive and finite")
    if len(f) != S or not np.all(np.isfinite(f)) or np.any(f < 0):
        raise ResplitError("one fixed time per stage, finite and not negative")
    if np.any(cur < 1):
        raise ResplitError("every stage holds at least one layer now")
    L = int(cur.sum())
    costs = np.ones(L) if layer_costs is None else np.asarray(layer_costs, dtype=np.float64)
    if len(costs) != L or np.any(costs <= 0):
        raise ResplitError(f"layer_costs needs {L} positive entries")
    prefix = _prefix(L, costs)
    speed = _work(prefix, cur) / t                                # work per second
    current = float((t + f).max())
    # best[k, j]: smallest makespan for stages 0..k holding layers 0..j-1.
    inf = np.inf
    best = np.full((S, L + 1), inf)
    cut = np.zeros((S, L + 1), dtype=np.int64)
    best[0, 1:] = prefix[1:] / speed[0] + f[0]
    for k in range(1, S):
        for j in range(k + 1, L - (S - k - 1) + 1):
            i = np.arange(k, j)                        # stage k holds layers i..j-1
            cand = np.maximum(best[k - 1, i], (prefix[j] - prefix[i]) / speed[k] + f[k])
            m = int(np.argmin(cand))
            best[k, j], cut[k, j] = cand[m], i[m]
    split = []
    j = L
    for k in range(S - 1, 0, -1):
        i = int(cut[k, j])
        split.append(j - i)
        j = i
    split.append(j)
    split.reverse()
    return Resplit(tuple(split), float(best[S - 1, L]), current)
