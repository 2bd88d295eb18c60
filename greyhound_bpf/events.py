"""The event envelope (docs/events.md), shared by every stage.

Every stage emits plain dict events built here; consumers (JSON, text
summary, live view, metrics, tests) read the same events. The engine never
formats output.
"""
from __future__ import annotations

import time

SCHEMA_VERSION = 1

KINDS = frozenset({
    "attach", "call", "exit", "pattern", "iteration", "slowdown", "recovery", "diagnosis",
    "action", "applied", "lost", "detach", "topology", "validation", "activity",
    "unprobed_site",
    # the job's controller (greyhound_bpf.cluster): its agents and their nodes
    "agent", "agent_lost", "agent_left", "census", "gap", "node_event",
})


def make_event(kind: str, job: str, time_ns: int | None = None, **fields) -> dict:
    """An event in the envelope. time_ns defaults to now; the analysis passes
    the time of the data that caused an event, so a replay is deterministic."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    ev = {"v": SCHEMA_VERSION, "kind": kind,
          "time_ns": time.time_ns() if time_ns is None else int(time_ns), "job": job}
    ev.update(fields)
    return ev


def is_speed_sample(ev: dict) -> bool:
    """The one rule for whether an `iteration` event tells the job's speed:
    a rank's iteration that no activity of Greyhound's own (attaching, a
    validation pause, workers starting, a plan being applied) overlapped.
    Every detector, baseline, verdict, plan and view uses it. (`paused` and
    `settling` are the older spellings of two such activities.)"""
    return (ev.get("kind") == "iteration" and ev.get("rank") is not None
            and not ev.get("disturbed") and not ev.get("paused") and not ev.get("settling"))
