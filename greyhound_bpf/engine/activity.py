"""Greyhound's own activity that can touch the job, with its span.

Attaching uprobes, validation workers starting (their imports), a
validation pause, a plan being applied, and another greyhound validating on
the same machine all slow a job down for a moment. Each is recorded here
as a span [start_ns, end_ns) on the analysis clock (end None while it
lasts), and an iteration that overlaps one is *disturbed*: it is reported,
but kept out of every detector, baseline, verdict and plan
(`greyhound_bpf.events.is_speed_sample`). Pure bookkeeping: the spans come
in as inputs of the analysis.
"""
from __future__ import annotations

from dataclasses import dataclass

# What can disturb the job, by the name the spans and iteration events carry.
WHAT = ("attach", "workers", "pause", "plan", "other")
# Spans kept: older ones no longer overlap any iteration still to come.
KEEP = 64


@dataclass
class Span:
    id: str
    what: str
    start_ns: int
    end_ns: int | None = None          # None while it lasts

    def overlaps(self, start_ns: int, end_ns: int) -> bool:
        return start_ns < (self.end_ns if self.end_ns is not None else end_ns + 1) \
            and end_ns > self.start_ns

    def fields(self) -> dict:
        return {"id": self.id, "what": self.what, "start_ns": self.start_ns,
                "end_ns": self.end_ns}


class ActivityLog:
    def __init__(self):
        self.spans: list[Span] = []

    def update(self, id: str, what: str, start_ns: int, end_ns: int | None) -> Span:
        """Open a span, or close (or move) the one with this id."""
        if what not in WHAT:
            raise ValueError(f"unknown activity {what!r}")
        for s in reversed(self.spans):
            if s.id == id:
                s.start_ns, s.end_ns = start_ns, end_ns
                return s
        s = Span(id, what, start_ns, end_ns)
        self.spans.append(s)
        del self.spans[:-KEEP]
        return s

    def disturbing(self, start_ns: int, end_ns: int) -> Span | None:
        """The first span that overlaps [start_ns, end_ns), if any."""
        for s in self.spans:
            if s.overlaps(start_ns, end_ns):
                return s
        return None

    def open(self) -> bool:
        return any(s.end_ns is None for s in self.spans)

    def near(self, t_ns: int, before_ns: int) -> list[Span]:
        """Spans still open, or that ended after t_ns - before_ns."""
        return [s for s in self.spans if s.end_ns is None or s.end_ns >= t_ns - before_ns]
