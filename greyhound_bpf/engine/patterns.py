"""What the iteration estimator (iterations.py) reports: one
`IterationRecord` per iteration, a `PatternChange` when a rank's call
pattern is (re-)estimated, and the fields a node's agent publishes of each
iteration."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class IterationRecord:
    rank: int | None
    index: int           # iteration number since the pattern was locked
    start_ns: int        # end of the previous iteration's last call
    dur_ns: int          # to the end of this iteration's last call
    period_calls: int    # calls in this iteration
    comm_ns: int         # time inside blocking calls (union over threads)
    compute_ns: int      # dur_ns - comm_ns
    p2p_ns: int = 0      # of comm_ns, inside point-to-point calls (a pipeline's sends)
    period: int = 0      # the pattern's period in calls (0: not known, older recordings)
    # Its collectives' (start, end) in µs from start_ns, flat: s0, e0, s1, e1...
    # (empty: a short iteration, or none; see iterations.ARRIVALS_FROM_NS)
    arrivals: tuple[int, ...] = ()

    def fields(self) -> dict:
        out = {"rank": self.rank, "index": self.index, "start_ns": self.start_ns,
               "dur_ns": self.dur_ns, "period_calls": self.period_calls,
               "comm_ns": self.comm_ns, "compute_ns": self.compute_ns,
               "p2p_ns": self.p2p_ns, "period": self.period}
        if self.arrivals:
            out["arrivals"] = list(self.arrivals)
        return out

    @classmethod
    def from_fields(cls, rank: int | None, d: dict) -> "IterationRecord":
        """The record `fields()` (or an agent's item of ITERATION_FIELDS)
        wrote; a field an older agent or recording lacks takes its default."""
        return cls(rank, **{k: tuple(map(int, d[k])) if k == "arrivals" else int(d[k])
                            for k in ITERATION_FIELDS if k in d})


# What a node's agent publishes of each iteration (its rank is the key):
# all of it, so that the controller's analysis reads what the agent's did.
ITERATION_FIELDS = tuple(f.name for f in dataclasses.fields(IterationRecord) if f.name != "rank")


@dataclass(frozen=True)
class PatternChange:
    """The per-iteration call pattern was (re-)estimated."""
    rank: int | None
    period_calls: int
    previous: int | None   # the period before, None the first time
    reason: str            # "locked" (first estimate) or "changed"
    at_ns: int
    acf_peak: float        # adjusted ACF at the period
    anchor_score: float    # share of iterations the anchor marks cleanly
    gap_classes: bool      # whether long host gaps were needed to see the period

    def fields(self) -> dict:
        return {"rank": self.rank, "period_calls": int(self.period_calls),
                "previous": None if self.previous is None else int(self.previous),
                "reason": self.reason, "acf_peak": round(self.acf_peak, 4),
                "anchor_score": round(self.anchor_score, 4), "gap_classes": self.gap_classes}
