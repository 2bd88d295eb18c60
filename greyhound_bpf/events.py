"""The event envelope (docs/events.md), shared by every stage.

Every stage emits plain dict events built here; consumers (JSON, text
summary, tests) read the same events. The engine never formats output.
"""
from __future__ import annotations

import time

SCHEMA_VERSION = 1

KINDS = frozenset({
    "attach", "call", "exit", "pattern", "iteration", "slowdown", "recovery", "diagnosis",
    "action", "applied", "lost", "detach", "topology",
})


def make_event(kind: str, job: str, time_ns: int | None = None, **fields) -> dict:
    """An event in the envelope. time_ns defaults to now; engine events pass
    the time of the data that caused them, so a replay is deterministic."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    ev = {"v": SCHEMA_VERSION, "kind": kind,
          "time_ns": time.time_ns() if time_ns is None else int(time_ns), "job": job}
    ev.update(fields)
    return ev
