"""`greyhound-trace replay FILE`: feed a recording's inputs to a JobAnalysis
and print its events.

A recording made with `attach --record FILE` holds every input of the live
run's analysis, in order: the replay gives the live run's events exactly
(diagnoses, validation requests and actions included), and a change to a
rule is judged by replaying recorded runs (scripts/bench_scenarios). An
event stream made with `attach -o FILE --calls` (the older format)
holds only the calls: its replay gives the engine's events.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from . import GreyhoundError
from .analysis import Activity, JobAnalysis
from .probe.catalog import Catalog, load_catalog
from .recording import Recording


def replay(path: str, catalog: Catalog | None = None, *, settle_until_ns: int | None = None,
           **config) -> list[dict]:
    """Every event the analysis emits over the recording at `path`.
    `config` overrides the recorded analysis settings (threshold=0.2...);
    `settle_until_ns` treats the iterations before it as disturbed by an
    attach (to try how a later attach would have seen the job)."""
    catalog = catalog or load_catalog()
    rec = Recording(path, catalog)
    analysis = JobAnalysis(catalog, rec.job, replace(rec.config, **config))
    events: list[dict] = []
    if settle_until_ns is not None:
        analysis.feed(Activity(0, "replay-settle", "attach", 0, settle_until_ns))
    for inp in rec.inputs():
        try:
            events += analysis.feed(inp)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError,
                OverflowError) as e:
            # A hostile or hand-edited recording: name the line, never a traceback.
            raise GreyhoundError(f"{path}:{getattr(rec, 'lineno', '?')}: an input the analysis "
                                 f"cannot take ({type(e).__name__}: {e})") from None
    if rec.cut:
        # Its recorder was killed (SIGKILL, a crash): what it wrote whole is
        # replayed; what it had not finished writing is gone.
        print(f"greyhound-trace: warning: {path} breaks off at line {rec.cut[0]} (its "
              "recorder stopped mid-write): replayed the inputs before it", file=sys.stderr)
    return events
