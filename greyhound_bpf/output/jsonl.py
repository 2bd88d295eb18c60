"""JSON-lines output of the event stream (`-j`, `-o FILE`)."""
from __future__ import annotations

import json
import sys
from typing import IO


def plain(o):
    """A NumPy scalar as the Python number it holds (a stage that forgot
    to convert one must not take the tracer down)."""
    item = getattr(o, "item", None)
    if item is not None:
        return item()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


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
            self._fh.write(json.dumps(event, separators=(",", ":"), default=plain) + "\n")
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
