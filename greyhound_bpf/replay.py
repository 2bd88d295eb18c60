"""`greyhound-trace replay FILE`: run the engine over a recording made with
`attach --json FILE --calls`, and print the engine's events.

The calls are fed in file order, in fixed-size chunks, through the same
JobPipeline as `attach`; event times come from the data. The same file
therefore always gives the same events.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Iterator

import numpy as np

from . import GreyhoundError
from .probe.catalog import Catalog, load_catalog
from .events import make_event
from .engine.pipeline import JobPipeline

# Calls per feed: about what one 100 ms tracer batch holds for a small job,
# so ranks interleave as they do live.
CHUNK = 256


def read_calls(path: str) -> Iterator[tuple[str | None, list[dict]]]:
    """(job, chunk of call events) in file order."""
    try:
        fh = open(path)
    except OSError as e:
        raise GreyhoundError(f"cannot read {path}: {e.strerror}") from None
    job, chunk = None, []
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                raise GreyhoundError(f"{path}:{lineno}: not a JSON line") from None
            if not isinstance(ev, dict) or "kind" not in ev:
                raise GreyhoundError(f"{path}:{lineno}: not a greyhound event")
            if ev.get("v") != 1:
                raise GreyhoundError(f"{path}:{lineno}: unknown schema version {ev.get('v')!r}")
            job = job or ev.get("job")
            if ev["kind"] == "call":
                chunk.append(ev)
                if len(chunk) >= CHUNK:
                    yield job, chunk
                    chunk = []
    if chunk:
        yield job, chunk


def replay(path: str, catalog: Catalog | None = None, **pipeline_args) -> list[dict]:
    catalog = catalog or load_catalog()
    pipe = JobPipeline(catalog, **pipeline_args)
    events: list[dict] = []
    seen_calls = 0
    job = None
    for job, chunk in read_calls(path):
        seen_calls += len(chunk)
        by_pid: dict[int, list[dict]] = defaultdict(list)
        for c in chunk:
            by_pid[c["pid"]].append(c)
        for pid, calls in by_pid.items():
            fns = []
            for c in calls:
                fn = catalog.by_name.get(c["fn"])
                if fn is None:
                    raise GreyhoundError(f"{path}: unknown function {c['fn']!r}")
                fns.append(fn.fid)
            pipe.add_rank(pid, calls[0].get("rank"))
            out = pipe.feed_calls(
                pid, np.array(fns, dtype=np.int64),
                np.array([c.get("comm") or 0 for c in calls], dtype=np.uint64),
                np.array([c["start_ns"] for c in calls], dtype=np.int64),
                np.array([c["dur_ns"] for c in calls], dtype=np.int64),
                np.array([c.get("count") or 0 for c in calls], dtype=np.uint64))
            events += [make_event(kind, job or "replay", t, **fields) for kind, fields, t in out]
    if seen_calls == 0:
        raise GreyhoundError(f"{path} holds no call events: record with `attach --json FILE --calls`")
    return events
