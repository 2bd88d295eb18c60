"""The event envelope (docs/events.md) and its JSON-lines encoder.

Every stage emits plain dict events built here; consumers (JSON, text
summary, tests) read the same events. The engine never formats output.
"""
from __future__ import annotations

import json
import sys
import time
from typing import IO

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


class JsonLinesWriter:
    """Writes one compact JSON object per line and flushes per batch.

    ``path`` "-" is standard output. A consumer that goes away (EPIPE) stops
    the writer rather than the tracer.
    """

    def __init__(self, path: str):
        self.path = path
        self._fh: IO[str] = sys.stdout if path == "-" else open(path, "a", buffering=1 << 16)
        self.closed = False

    def write(self, event: dict) -> None:
        if self.closed:
            return
        try:
            self._fh.write(json.dumps(event, separators=(",", ":")) + "\n")
        except BrokenPipeError:
            self.closed = True

    def flush(self) -> None:
        if self.closed:
            return
        try:
            self._fh.flush()
        except BrokenPipeError:
            self.closed = True

    def close(self) -> None:
        self.flush()
        if self._fh is not sys.stdout:
            self._fh.close()
        self.closed = True
