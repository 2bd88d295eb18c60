"""A diagnosis: which rank or link, computation or communication, and from
which evidence. One type for every producer (the passive rules, the
cross-sectional comparison, validation) and every consumer (the policy,
the outputs); it is the `diagnosis` event's content (docs/events.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

CAUSES = ("computation", "communication", "unknown")
EVIDENCE = ("passive", "validation")


@dataclass(frozen=True)
class Diagnosis:
    evidence: str                       # passive (from the calls) or validation (measured)
    cause: str                          # computation / communication / unknown
    reason: str                         # the verdict in words, with the numbers
    index: int | None = None            # the slowdown's onset iteration, when there is one
    ranks: tuple[int, ...] = ()
    communicator: str | None = None
    link: str | None = None
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")
        if self.evidence not in EVIDENCE:
            raise ValueError(f"unknown evidence {self.evidence!r}")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    @property
    def named(self) -> bool:
        """A cause is named (not `unknown`)."""
        return self.cause != "unknown"

    @property
    def straggler(self) -> int | None:
        """The one rank computing slower, when that is the verdict."""
        if self.cause == "computation" and len(self.ranks) == 1:
            return self.ranks[0]
        return None

    def fields(self) -> dict:
        return {"evidence": self.evidence, "index": self.index, "cause": self.cause,
                "ranks": list(self.ranks), "communicator": self.communicator,
                "link": self.link, "reason": self.reason, "details": self.details}

    @classmethod
    def from_event(cls, ev: dict) -> "Diagnosis":
        return cls(ev["evidence"], ev["cause"], ev.get("reason", ""), ev.get("index"),
                   tuple(ev.get("ranks") or ()), ev.get("communicator"), ev.get("link"),
                   dict(ev.get("details") or {}))

    def but(self, **changes) -> "Diagnosis":
        """A copy with some fields changed."""
        from dataclasses import replace
        return replace(self, **changes)
