"""S3: re-split a pipeline's layers across its stages.

``resplit`` gives each pipeline stage a contiguous run of layers (at least
one) so that the slowest stage finishes first: stage k's speed is measured
as the work it holds now over the time it takes (its compute per
iteration), and the new split minimises max_k work(stage k) / speed_k.
Exact, by dynamic programming over layer boundaries (O(S * L^2); 128
stages x 1,000 layers takes well under a second). With equal layers this is
S2's problem and gives the same counts.

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


def resplit(stage_times, current_split, layer_costs=None) -> Resplit:
    """stage_times[k]: measured compute time of stage k with current_split."""
    t = np.asarray(stage_times, dtype=np.float64)
    cur = np.asarray(current_split, dtype=np.int64)
    S = len(t)
    if S == 0 or len(cur) != S:
        raise ResplitError("one measured time per stage, and one layer count per stage")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ResplitError("stage times must be positive and finite")
    if np.any(cur < 1):
        raise ResplitError("every stage holds at least one layer now")
    L = int(cur.sum())
    costs = np.ones(L) if layer_costs is None else np.asarray(layer_costs, dtype=np.float64)
    if len(costs) != L or np.any(costs <= 0):
        raise ResplitError(f"layer_costs needs {L} positive entries")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    bounds = np.concatenate([[0], np.cumsum(cur)])
    speed = (prefix[bounds[1:]] - prefix[bounds[:-1]]) / t       # work per second
    current = float(t.max())
    # best[k, j]: smallest makespan for stages 0..k holding layers 0..j-1.
    inf = np.inf
    best = np.full((S, L + 1), inf)
    cut = np.zeros((S, L + 1), dtype=np.int64)
    best[0, 1:] = prefix[1:] / speed[0]
    for k in range(1, S):
        for j in range(k + 1, L - (S - k - 1) + 1):
            i = np.arange(k, j)                        # stage k holds layers i..j-1
            cand = np.maximum(best[k - 1, i], (prefix[j] - prefix[i]) / speed[k])
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
