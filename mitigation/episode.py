"""The policy's state: one rank's recent samples, and one fault episode
(from a job slowdown, or a verdict on a job already slow, to its end).
Plain data; mitigation.policy decides."""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

# Is the fault gone? A recheck of the straggler's device (or a trial) this
# long after the plan was applied, then at this interval or doubling ones
# (mitigation.gone).
RECHECK_AFTER_S = 20.0


@dataclass
class Rank:
    end_ns: deque
    dur_ms: deque
    compute_ms: deque
    count: deque                  # micro-batches this rank ran in each sample
    p2p_ms: deque                 # of its waits, in point-to-point calls (a pipeline's)

    def _queues(self) -> tuple:
        return self.end_ns, self.dur_ms, self.compute_ms, self.count, self.p2p_ms

    def clear(self) -> None:
        for q in self._queues():
            q.clear()

    def keep_after(self, ns: int) -> None:
        """Only the samples that ended after `ns`."""
        keep = [x for x in zip(*self._queues()) if x[0] > ns]
        self.clear()
        for x in keep:
            for q, v in zip(self._queues(), x):
                q.append(v)

    def recent(self, span_ns: int, least: int) -> int:
        """Where the recent samples begin: those that ended within `span_ns`
        of the newest, and at least the newest `least`."""
        if not self.end_ns:
            return 0
        first = bisect.bisect_left(self.end_ns, self.end_ns[-1] - span_ns)  # ends in order
        return max(0, min(first, len(self.end_ns) - least))

    def span_ns(self, start: int = 0) -> int:
        """How long the samples from `start` cover, end to end."""
        if len(self.end_ns) - start < 2:
            return 0
        return self.end_ns[-1] - self.end_ns[start] + int(self.dur_ms[start] * 1e6)

    def per_microbatch(self, start: int = 0) -> float | None:
        """Compute per micro-batch over the samples from `start`: their total
        over their micro-batches, a mean. A CFS quota makes a throttled
        rank's iterations fast or stalled for the rest of its 100 ms
        period, and a median reads the fast ones: the rank looks healthy
        while the job runs at its throughput (bench_mitigation: a median of
        12.9 ms where the trainer's own log read 15.5). On a slow GPU the
        mean and the median agree."""
        pairs = [(c, n) for c, n in islice(zip(self.compute_ms, self.count), start, None) if n]
        return sum(c for c, _ in pairs) / sum(n for _, n in pairs) if pairs else None

    def mean_ms(self, start: int = 0) -> float | None:
        """The mean iteration over the samples from `start` (as above)."""
        d = list(islice(self.dur_ms, start, None))
        return sum(d) / len(d) if d else None


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
    refine_looked: bool = False          # the plan in force was measured for a refinement
    recheck_at_ns: int | None = None
    recheck_every_s: float = RECHECK_AFTER_S
    looks_ms: float = 0.0                # what the looks at that interval cost the job
    even_ms: float | None = None         # the job's time at the even split, slow
    at_even: dict | None = None          # dp rank -> (micro-batches, mean compute) there
    trial: dict | None = None            # a trial return to even in progress
    trial_due_ns: int | None = None      # a recheck was refused: a trial instead
    restart_considered: bool = False


def two_split_lines(order: list, t: dict, split: dict, at_even: dict) -> tuple[list, list]:
    """Per rank (in `order`), time per micro-batch and fixed time per
    iteration from its mean compute at the even split (`at_even`: rank ->
    (micro-batches, mean compute)) and under the plan (`t`: time per
    micro-batch at `split`): a line through the two points. One point says
    nothing of a rank's fixed costs (its step, its collectives' CPU under a
    quota), and the line through zero blames them on its micro-batches:
    under the plan the straggler's time per micro-batch grew (1.22 -> 1.60
    ms at 8 -> 5 of 16, bench_mitigation) and a refinement moved work off
    it that the sweep showed slower. A slope under a quarter of the mean is
    noise: the line through zero then, and so is a line whose fixed time
    would be negative (a CFS quota: a throttled rank given less work stays
    under its quota and runs faster per micro-batch), which must still pass
    through what the plan measured."""
    per, fixed = [], []
    for k in order:
        n1 = split[k]
        c1 = t[k] * n1
        n0, c0 = at_even.get(k, (n1, c1))
        b = (c1 - c0) / (n1 - n0) if n1 != n0 else 0.0
        if b < 0.25 * c1 / n1 or b > c1 / n1:
            b = c1 / n1
        per.append(b)
        fixed.append(max(0.0, c1 - b * n1))
    return per, fixed
