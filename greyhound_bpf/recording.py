"""Recordings of the analysis's inputs: `attach --record FILE` writes every
input of its JobAnalysis in the order it was fed, and `greyhound-trace
replay FILE` feeds them again, so a replay gives the live run's events
exactly (its `iteration`, `slowdown`, `diagnosis`, `action`... events).

Format: JSON lines, gzip-compressed when the name ends in `.gz` (read
either way). The first line is the header: `greyhound_recording` (the
format version), `job`, `config` (analysis.AnalysisConfig), `functions`
(the catalog's function names, in the order the recorded `fn` ids use) and
`greyhound` (the tool's version). Then one line per input, `in` naming its
kind and `t` its time (ns, analysis clock):

    calls      one tracer batch, as columns: pid, tid, fn, start (the first
               value, then differences), dur, ret, flags, and args {slot: values}
               for the argument slots that are not all zero
    targets    added [{pid, rank, local_rank, world_size, comm}], exited [pid], begin
    activity   id, what, start, end (null while it lasts)
    validated  request, result (diagnosis.rules.Result.to_dict())
    acks       docs {rank: ack document}, restart_observed_s
    written    seq, error (null when the plan was written)
    tick       (time only)

Also read: an event stream written by `attach -o FILE --calls` (the
older recording format), which holds the calls but none of the other
inputs: its replay reproduces the engine's events only.
"""
from __future__ import annotations

import gzip
import json
from typing import IO, Iterator

import numpy as np

from . import GreyhoundError, __version__
from .analysis import (INPUTS, Activity, Acks, AnalysisConfig, Calls, Collectives, Communicators,
                       Iterations, PlanWritten, Targets, Tick, Validated)
from .output.jsonl import JsonLinesWriter
from .probe.catalog import Catalog
from .probe.records import CALL_DTYPE, GH_MAX_ARGS

FORMAT = 1
# Calls per input when replaying an older event-stream recording: about what
# one 100 ms tracer batch holds for a small job, so ranks interleave as live.
LEGACY_CHUNK = 256
_NAME = {Calls: "calls", Targets: "targets", Activity: "activity", Validated: "validated",
         Acks: "acks", PlanWritten: "written", Tick: "tick", Iterations: "iterations",
         Communicators: "communicators", Collectives: "collectives"}
assert set(_NAME) == set(INPUTS)


# -- writing ----------------------------------------------------------------------------

def encode(inp, slot_mask: np.ndarray | None = None) -> dict:
    """One input as a JSON-able line. `slot_mask` (Catalog.slot_mask()): the
    argument slots worth keeping; the others hold left-over register values
    that nothing reads."""
    kind = _NAME[type(inp)]
    d: dict = {"in": kind, "t": int(inp.t_ns)}
    if isinstance(inp, Calls):
        r = inp.recs
        args = r["args"]
        if slot_mask is not None and len(r):
            args = np.where(slot_mask[r["fn"].astype(np.int64)], args, 0)
        start = r["start_ns"].astype(np.int64)
        d.update(pid=r["pid"].tolist(), tid=r["tid"].tolist(), fn=r["fn"].tolist(),
                 start=np.concatenate([start[:1], np.diff(start)]).tolist(),
                 dur=r["dur_ns"].tolist(), ret=r["ret"].tolist(), flags=r["flags"].tolist(),
                 args={str(i): args[:, i].tolist() for i in range(GH_MAX_ARGS)
                       if args[:, i].any()})
    elif isinstance(inp, Targets):
        d.update(added=list(inp.added), exited=list(inp.exited), begin=inp.begin_ns)
    elif isinstance(inp, Activity):
        d.update(id=inp.id, what=inp.what, start=inp.start_ns, end=inp.end_ns)
    elif isinstance(inp, Validated):
        d.update(request=inp.request, result=inp.result)
    elif isinstance(inp, Acks):
        d.update(docs={str(k): v for k, v in inp.docs.items()},
                 restart_observed_s=inp.restart_observed_s)
    elif isinstance(inp, PlanWritten):
        d.update(seq=inp.seq, error=inp.error)
    elif isinstance(inp, Iterations):
        d.update(key=inp.key, items=list(inp.items))
    elif isinstance(inp, Communicators):
        d.update(node=inp.node, fields=inp.fields)
    elif isinstance(inp, Collectives):
        d.update(calls={str(k): [list(x) for x in v] for k, v in inp.calls.items()})
    return d


def header(job: str, config: AnalysisConfig, catalog: Catalog, **extra) -> dict:
    return {"greyhound_recording": FORMAT, "job": job, "config": config.to_dict(),
            "functions": [fn.name for fn in catalog.functions], "greyhound": __version__,
            **extra}


class Recorder:
    """Writes inputs as they are fed, as JSON lines (the event stream's
    writer: a write that fails, a full disk or a removed directory, stops
    the recording, says why in `error` and counts what could not be written
    in `dropped`; tracing goes on)."""

    def __init__(self, path: str, head: dict, catalog: Catalog | None = None):
        self.path = path
        self.mask = catalog.slot_mask() if catalog is not None else None
        try:
            self._out = JsonLinesWriter(path, mode="w")
        except OSError as e:
            raise GreyhoundError(f"--record {path}: {e.strerror or e}") from None
        self._out.write(head)

    @property
    def error(self) -> str | None:
        return self._out.error

    @property
    def dropped(self) -> int:
        return self._out.dropped

    def write(self, inp) -> None:
        self._out.write(encode(inp, self.mask))

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._out.close()


# -- reading ----------------------------------------------------------------------------

def _open(path: str) -> IO[str]:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
        return gzip.open(path, "rt") if magic == b"\x1f\x8b" else open(path)
    except OSError as e:
        raise GreyhoundError(f"cannot read {path}: {e.strerror}") from None


def _lines(path: str, cut: list | None = None) -> Iterator[tuple[int, dict]]:
    """Each line's object. A file that ends mid-line (its writer killed: a
    gzip stream without its end, or a last line without its newline) ends at
    its last whole line; with `cut`, the line number where it broke off is
    appended there, and without it that is an error."""
    fh = _open(path)
    with fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    if not line.endswith("\n") and cut is not None:
                        cut.append(lineno)          # the writer stopped mid-line
                        return
                    raise GreyhoundError(f"{path}:{lineno}: not a JSON line") from None
                if not isinstance(d, dict):
                    raise GreyhoundError(f"{path}:{lineno}: not a JSON object")
                yield lineno, d
        except EOFError as e:
            if cut is None:
                raise GreyhoundError(f"{path}:{lineno + 1}: unreadable ({e})") from None
            cut.append(lineno + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise GreyhoundError(f"{path}:{lineno + 1}: unreadable ({e})") from None


class Recording:
    """A recording opened for replay: `header`, `config`, and `inputs()`."""

    def __init__(self, path: str, catalog: Catalog):
        self.path, self.catalog = path, catalog
        self.lineno = 1                    # of the input last given (replay's errors)
        # Where a recording whose writer was killed breaks off: its inputs up
        # to there are replayed (replay says so), none of them lost.
        self.cut: list[int] = []
        it = _lines(path)
        try:
            lineno, first = next(it)
        except StopIteration:
            raise GreyhoundError(f"{path} is empty") from None
        it.close()
        self.legacy = "greyhound_recording" not in first
        if self.legacy:
            self.header = {"job": first.get("job") or "replay", "functions": None}
            self.config = AnalysisConfig()
            return
        if first["greyhound_recording"] != FORMAT:
            raise GreyhoundError(f"{path}:{lineno}: recording format "
                                 f"{first['greyhound_recording']!r}, this greyhound reads {FORMAT}")
        self.header = first
        self.config = AnalysisConfig.from_dict(first.get("config") or {})
        names = first.get("functions") or []
        missing = [n for n in names if n not in catalog.by_name]
        self._fn_map = np.array([catalog.by_name[n].fid if n in catalog.by_name else -1
                                 for n in names] or [0], dtype=np.int64)
        self._missing = missing

    @property
    def job(self) -> str:
        return self.header.get("job") or "replay"

    def inputs(self) -> Iterator:
        if self.legacy:
            yield from self._legacy()
            return
        it = _lines(self.path, self.cut)
        next(it)                           # the header
        for lineno, d in it:
            self.lineno = lineno
            try:
                yield self._decode(d)
            except GreyhoundError:
                raise
            except (KeyError, TypeError, ValueError, IndexError, OverflowError,
                    AttributeError) as e:
                raise GreyhoundError(f"{self.path}:{lineno}: malformed "
                                     f"{d.get('in', 'input')!r} input ({type(e).__name__}: {e})"
                                     ) from None

    def _decode(self, d: dict):
        kind, t = d.get("in"), int(d["t"])
        if kind == "calls":
            n = len(d["pid"])
            recs = np.zeros(n, dtype=CALL_DTYPE)
            fn = np.asarray(d["fn"], dtype=np.int64)
            if n and (fn.min() < 0 or fn.max() >= len(self._fn_map)
                      or (self._fn_map[fn] < 0).any()):
                raise GreyhoundError(f"{self.path}: a recorded function this catalog does not "
                                     f"have ({', '.join(self._missing) or 'bad id'})")
            recs["fn"] = self._fn_map[fn] if n else fn
            recs["pid"], recs["tid"] = d["pid"], d["tid"]
            recs["start_ns"] = np.cumsum(np.asarray(d["start"], dtype=np.int64))
            recs["dur_ns"], recs["ret"], recs["flags"] = d["dur"], d["ret"], d["flags"]
            for slot, vals in d.get("args", {}).items():
                recs["args"][:, int(slot)] = np.asarray(vals, dtype=np.uint64)
            return Calls(t, recs)
        if kind == "targets":
            added = tuple(d.get("added", ()))
            if not all(isinstance(a, dict) and type(a.get("pid")) is int for a in added):
                raise ValueError("a target without an integer pid")
            return Targets(t, added, tuple(int(p) for p in d.get("exited", ())),
                           d.get("begin"))
        if kind == "activity":
            return Activity(t, str(d["id"]), str(d["what"]), int(d["start"]), d.get("end"))
        if kind == "validated":
            return Validated(t, int(d["request"]), dict(d["result"]))
        if kind == "acks":
            return Acks(t, {int(k): v for k, v in d["docs"].items()},
                        d.get("restart_observed_s"))
        if kind == "written":
            return PlanWritten(t, int(d["seq"]), d.get("error"))
        if kind == "tick":
            return Tick(t)
        if kind == "iterations":
            items = tuple(d.get("items", ()))
            if not all(isinstance(i, dict) for i in items):
                raise ValueError("an iteration that is not an object")
            return Iterations(t, int(d["key"]), items)
        if kind == "communicators":
            return Communicators(t, str(d["node"]), dict(d["fields"]))
        if kind == "collectives":
            calls = {int(k): tuple(tuple(x) for x in v) for k, v in d["calls"].items()}
            if not all(len(x) == 3 for v in calls.values() for x in v):
                raise ValueError("a collective that is not [gap, start, end]")
            return Collectives(t, calls)
        raise GreyhoundError(f"{self.path}:{self.lineno}: unknown input {kind!r}")

    def _legacy(self) -> Iterator:
        """An `attach -o FILE --calls` event stream: its calls, in file
        order, LEGACY_CHUNK at a time; each process once as a target."""
        known: set[int] = set()
        chunk: list[dict] = []
        seen = 0
        for lineno, ev in _lines(self.path, self.cut):
            if "kind" not in ev:
                raise GreyhoundError(f"{self.path}:{lineno}: not a greyhound event")
            if ev.get("v") != 1:
                raise GreyhoundError(f"{self.path}:{lineno}: unknown schema version "
                                     f"{ev.get('v')!r}")
            if ev["kind"] != "call":
                continue
            try:
                pid, fn = int(ev["pid"]), self.catalog.by_name.get(ev["fn"])
                int(ev["start_ns"]), int(ev["dur_ns"])
            except (KeyError, TypeError, ValueError) as e:
                raise GreyhoundError(f"{self.path}:{lineno}: malformed call event ({e})") from None
            if fn is None:
                raise GreyhoundError(f"{self.path}:{lineno}: unknown function {ev['fn']!r}")
            if pid not in known:
                known.add(pid)
                if chunk:
                    yield self._legacy_calls(chunk)
                    chunk = []
                yield Targets(int(ev["start_ns"]), ({"pid": pid, "rank": ev.get("rank")},))
            chunk.append(ev)
            seen += 1
            if len(chunk) >= LEGACY_CHUNK:
                yield self._legacy_calls(chunk)
                chunk = []
        if chunk:
            yield self._legacy_calls(chunk)
        if seen == 0:
            raise GreyhoundError(f"{self.path} holds no call events: record with "
                                 "`attach --record FILE` (or `attach -o FILE --calls`)")

    def _legacy_calls(self, calls: list[dict]) -> Calls:
        recs = np.zeros(len(calls), dtype=CALL_DTYPE)
        for i, c in enumerate(calls):
            fn = self.catalog.by_name[c["fn"]]
            slots, ret, flags = self.catalog.encode(fn, c)
            recs[i] = (c["start_ns"], c["dur_ns"], c["pid"], c.get("tid", c["pid"]), fn.fid,
                       flags, ret, slots)
        return Calls(int(max(c["start_ns"] + c["dur_ns"] for c in calls)), recs)
