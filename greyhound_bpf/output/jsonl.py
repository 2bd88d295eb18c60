"""JSON-lines output of the event stream (`-j`, `-o FILE`)."""
from __future__ import annotations

import gzip
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
    the writer rather than the tracer. A write that fails (a full disk, an
    I/O error) stops it too: ``error`` says why, and ``dropped`` counts the
    events lost (those buffered since the last good flush, and every one
    after), for the caller to report. A name ending in `.gz` is compressed.
    """

    def __init__(self, path: str, mode: str = "a"):
        self.path = path
        if path == "-":
            self._fh: IO[str] = sys.stdout
        elif path.endswith(".gz"):
            self._fh = gzip.open(path, mode + "t", compresslevel=6)
        else:
            self._fh = open(path, mode, buffering=1 << 16)
        self.closed = False
        self.error: str | None = None
        self.dropped = 0
        self._unflushed = 0
        # Many machines: who wrote each event (a node's `node` and `agent`, or
        # the controller's `producer`), and `serial`, its number in this
        # stream (from 1), for readers that merge streams and drop repeats.
        self.stamp: dict = {}
        self.serial = 0

    def write(self, event: dict) -> None:
        if self.closed:
            self.dropped += self.error is not None
            return
        if self.stamp:
            self.serial += 1
            event = {**self.stamp, **event, "serial": self.serial}
        try:
            self._fh.write(json.dumps(event, separators=(",", ":"), default=plain) + "\n")
            self._unflushed += 1
        except BrokenPipeError:
            self.closed = True
        except OSError as e:
            self._fail(e, self._unflushed + 1)

    def flush(self) -> None:
        if self.closed:
            return
        try:
            self._fh.flush()
            self._unflushed = 0
        except BrokenPipeError:
            self.closed = True
        except OSError as e:
            self._fail(e, self._unflushed)

    def _fail(self, e: OSError, lost: int) -> None:
        self.error = e.strerror or str(e)
        self.dropped += lost
        self.closed = True
        if self._fh is not sys.stdout:
            try:
                self._fh.close()       # its buffer cannot be written either
            except OSError:
                pass

    def close(self) -> None:
        self.flush()
        if self._fh is not sys.stdout and not self._fh.closed:
            try:
                self._fh.close()
            except OSError as e:
                self._fail(e, self._unflushed)
        self.closed = True
