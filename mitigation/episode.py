"""The policy's state: one rank's recent samples, and one fault episode
(from a job slowdown, or a verdict on a job already slow, to its end).
Plain data; mitigation.policy decides."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Is the fault gone? A recheck of the straggler's device this long after the
# plan was applied, then at doubling intervals (mitigation.policy).
RECHECK_AFTER_S = 20.0


@dataclass
class Rank:
    end_ns: deque
    dur_ms: deque
    compute_ms: deque
    count: deque                  # micro-batches this rank ran in each sample

    def clear(self) -> None:
        for q in (self.end_ns, self.dur_ms, self.compute_ms, self.count):
            q.clear()

    def per_microbatch(self) -> float | None:
        """Compute per micro-batch: the median over these samples."""
        vals = [c / n for c, n in zip(self.compute_ms, self.count) if n]
        return statistics.median(vals) if vals else None


@dataclass
class Episode:
    onset_ns: int
    healthy_ms: float | None
    loss_ms: float = 0.0
    straggler: int | None = None         # dp rank
    evidence: str = ""                   # what named it
    gemm_ratio: float | None = None      # validated: its device against the reference
    named_slow: set = field(default_factory=set)
    changes: int = 0                     # plans made (not counting the return to even)
    said_none: str | None = None         # the last `none` reason said
    plan_ms: float | None = None         # the prediction of the plan in force
    planned_for: int | None = None       # the straggler the plan in force works around
    refined: bool = False
    recheck_at_ns: int | None = None
    recheck_every_s: float = RECHECK_AFTER_S
    even_ms: float | None = None         # the job's time at the even split, slow
    trial: dict | None = None            # a trial return to even in progress
    trial_due_ns: int | None = None      # a recheck was refused: a trial instead
    restart_considered: bool = False
