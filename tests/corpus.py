"""The scenario corpus (tests/scenarios): load a recorded scenario and its
truth, replay it through JobAnalysis, and score what the analysis said
against what was done. Shared by tests/test_scenarios.py (which pins the
verdicts) and scripts/bench_scenarios (which prints the table).

Scoring, per scenario:
- a named diagnosis (cause not `unknown`) is *right* when it names the fault
  that was in force (or ended at most GRACE_S before it): for a compute
  fault `computation` and that rank; for a link fault `communication`, and
  from validation also the rank's link (`rank R`: passive evidence cannot
  name a link inside a ring all-reduce). Anything else named is *wrong*,
  including any named verdict while no fault was in force;
- detection: per fault, the delay from its start (or from the attach, for
  one that began before it) to the first job `slowdown`, to the first right
  passive verdict, and to the first right validated one;
- false alarms: job slowdowns that begin outside every fault, and whether
  the job's own log shows the job slower then (the host disturbed it:
  `confirmed`) or not (`unconfirmed`);
- plans: every advised or written action other than `none`, in a fault or
  not, with its predicted gain; validations and the time they paused the job.
"""
from __future__ import annotations

import functools
import json
import multiprocessing
import os
import statistics
import tomllib
import traceback
from pathlib import Path

from greyhound_bpf.engine.iterations import ITERATION_FIELDS

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
# A verdict may come this long after its fault ended (validation confirms
# after the job has run 3 s; a verdict waits for the evidence to end).
GRACE_S = 10.0
# A job slowdown is confirmed by the job's own log when its iterations over
# the new level are this much slower than over the level before (half the
# detector's threshold: the log's windows are the detector's, give or take).
CONFIRM_RATIO = 1.05


def names(split: str | None = None) -> list[str]:
    out = []
    for p in sorted(SCENARIOS.glob("*.truth.json")):
        t = json.loads(p.read_text())
        if split is None or t["split"] == split:
            out.append(t["name"])
    return out


def truth(name: str) -> dict:
    return json.loads((SCENARIOS / f"{name}.truth.json").read_text())


def expectations(name: str) -> list[dict]:
    """Per fault of the scenario, what its verdicts must be (corpus.toml's
    `expect`: one table for every fault, or a list with one per fault):
    `passive` / `validated` (named right, default true), `passive_within_s`."""
    sc = _scenario(name)
    n = len(sc.get("fault", []))
    e = sc.get("expect", {})
    return e if isinstance(e, list) else [e] * n


def known_miss(name: str, what: str = "miss") -> str | None:
    """A held-out scenario's recorded miss (corpus.toml's `miss`: why its
    fault was not named in time; `miss_ranks`: why its ranks were not each
    seen), kept as it failed: no rule was tuned on it, and its test is a
    strict xfail that fails the day it passes."""
    return _scenario(name).get(what)


@functools.cache
def _rows() -> dict[str, dict]:
    with open(SCENARIOS / "corpus.toml", "rb") as fh:
        return {s["name"]: s for s in tomllib.load(fh)["scenario"]}


def _scenario(name: str) -> dict:
    """The scenario's row of corpus.toml."""
    return _rows()[name]


def replay(name: str, **config) -> list[dict]:
    from greyhound_bpf.replay import replay as run
    return run(str(SCENARIOS / f"{name}.rec.gz"), **config)


def score_one(name: str) -> tuple[str, dict | str]:
    try:
        return name, score(truth(name), replay(name))
    except Exception:           # one scenario's failure is its own tests' failure
        return name, traceback.format_exc()


def score_all(names: list[str]) -> dict[str, dict | str]:
    """Each scenario replayed and scored, one process per usable core (a
    replay is pure: test_replay_is_deterministic_across_processes), so the
    corpus's replays take half the time on CI's two cores. A scenario whose
    replay raised maps to the traceback."""
    n = min(len(os.sched_getaffinity(0)), len(names))
    if n <= 1:
        return dict(map(score_one, names))
    with multiprocessing.get_context("forkserver").Pool(n) as pool:
        return dict(pool.imap_unordered(score_one, names))


def attached_later(name: str, at_ns: int, for_s: float) -> dict:
    """How a later attach would have read the job's iterations: the
    recording's calls from `at_ns` on, `for_s` seconds of them, fed to a new
    JobPipeline with every rank known (as an attach makes it). Per rank:
    (period locked at the end, None if none; iterations)."""
    from greyhound_bpf.analysis import Calls, Targets
    from greyhound_bpf.engine.pipeline import JobPipeline
    from greyhound_bpf.probe.catalog import load_catalog
    from greyhound_bpf.recording import Recording
    catalog = load_catalog()
    pipeline = JobPipeline(catalog)
    rank_of: dict[int, int | None] = {}
    iterations: dict[int | None, int] = {}
    for inp in Recording(str(SCENARIOS / f"{name}.rec.gz"), catalog).inputs():
        if isinstance(inp, Targets):
            for a in inp.added:
                rank_of[a["pid"]] = a.get("rank")
                pipeline.add_rank(a["pid"], a.get("rank"))
        elif isinstance(inp, Calls) and len(inp.recs):
            recs = inp.recs[inp.recs["start_ns"] >= at_ns]
            if len(recs) and recs["start_ns"].min() > at_ns + for_s * 1e9:
                break
            for kind, f, _ in pipeline.feed_records(recs, rank_of):
                if kind == "iteration":
                    iterations[f["rank"]] = iterations.get(f["rank"], 0) + 1
    return {rs.rank: (rs.estimator.period if rs.estimator.state == "locked" else None,
                      iterations.get(rs.rank, 0)) for rs in pipeline.ranks.values()}


def collective_times(name: str) -> list[int]:
    """When the recording's collectives started (any rank), in order."""
    import numpy as np
    from greyhound_bpf.analysis import Calls
    from greyhound_bpf.probe.catalog import load_catalog
    from greyhound_bpf.recording import Recording
    catalog = load_catalog()
    coll = np.array([fn.kind == "collective" for fn in catalog.functions])
    out = [inp.recs["start_ns"][coll[inp.recs["fn"]]]
           for inp in Recording(str(SCENARIOS / f"{name}.rec.gz"), catalog).inputs()
           if isinstance(inp, Calls) and len(inp.recs)]
    return sorted(np.concatenate(out).tolist())


def iterations_by_rank(events: list[dict]) -> dict[int, list[dict]]:
    """The `iteration` events among `events`, per rank, as an agent
    publishes them (analysis.Iterations items)."""
    out: dict[int, list[dict]] = {}
    for e in events:
        if e["kind"] == "iteration":
            out.setdefault(e["rank"], []).append({k: e[k] for k in ITERATION_FIELDS if k in e})
    return out


def _window(f: dict, t: dict) -> tuple[int, int]:
    # From the start of the iteration the fault began in (up to a second
    # before it was applied) to GRACE_S after it ended.
    end = f["end_ns"] if f["end_ns"] is not None else t["end_ns"]
    return f["start_ns"] - int(1e9), end + int(GRACE_S * 1e9)


def _fault_at(t: dict, at_ns: int) -> dict | None:
    for f in t["faults"]:
        lo, hi = _window(f, t)
        if lo <= at_ns < hi:
            return f
    return None


def right(d: dict, f: dict) -> bool:
    if f["kind"] == "compute":
        return d["cause"] == "computation" and d["ranks"] == [f["rank"]]
    if d["evidence"] == "passive":
        return d["cause"] == "communication"
    return d["cause"] == "communication" and d["link"] == f"rank {f['rank']}"


def job_log(truth: list[dict], t0_ns: int | None = None) -> dict:
    """The job's own log as `confirmed` reads it, from a trainer's truth
    records: every rank's iterations, start to start, pooled in time order
    ([ms since t0, ms]). The ranks are held in step, so each rank's times
    are the job's pace plus where in its loop that rank reads the clock;
    one rank alone can be a poor witness (a parameter server's loop top,
    after a broadcast that returns before the workers have it, read 10-35
    ms around its workers' steady 18-20 ms, and its median alone missed two
    slowdowns of 8% that each worker's log showed). The recordings' truth
    holds rank 0's log only (scripts/record_scenario.py)."""
    per_rank: dict = {}
    for r in truth:
        if "start_ns" in r and r.get("rank") is not None:
            per_rank.setdefault(r["rank"], []).append(r["start_ns"])
    if t0_ns is None:
        t0_ns = min((min(s) for s in per_rank.values()), default=0)
    rows = []
    for starts in per_rank.values():
        starts.sort()
        rows += [[(a - t0_ns) / 1e6, (b - a) / 1e6] for a, b in zip(starts, starts[1:])]
    return {"job_log_t0_ns": t0_ns, "job_log": sorted(rows)}


def _job_ms(t: dict, lo_ns: int, hi_ns: int) -> float | None:
    t0 = t["job_log_t0_ns"]
    d = [ms for at, ms in t["job_log"] if lo_ns <= t0 + at * 1e6 < hi_ns]
    return statistics.median(d) if len(d) >= 3 else None


def log_readings(t: dict, e: dict) -> tuple[float | None, float | None, int]:
    """The job's own log over a slowdown's own windows: its iteration (ms)
    over the iterations the detector compared with before the onset (from
    `baseline_ns`; about 50 in recordings older than that field), and over
    the new level until it was detected (at least 3 iterations); and that
    second window's length (ns)."""
    onset = e["onset_ns"]
    before_ns = max(onset - e.get("baseline_ns", onset - int(50 * e["before_ms"] * 1e6)),
                    int(3 * e["before_ms"] * 1e6))
    after_ns = max(e["time_ns"] - onset, int(3 * e["after_ms"] * 1e6))
    return (_job_ms(t, onset - before_ns, onset), _job_ms(t, onset, onset + after_ns),
            after_ns)


def confirmed(t: dict, e: dict) -> bool:
    """The job's own log shows it slower over the slowdown's own windows."""
    before, after, _ = log_readings(t, e)
    return before is not None and after is not None and after >= CONFIRM_RATIO * before


def score(t: dict, events: list[dict]) -> dict:
    named = [e for e in events if e["kind"] == "diagnosis" and e["cause"] != "unknown"]
    wrong, rightv = [], []
    for d in named:
        # A validation's verdict is about the time it measured.
        at = d["details"].get("measured_at_ns") or d["time_ns"]
        f = _fault_at(t, at)
        (rightv if f is not None and right(d, f) else wrong).append(d)
    faults = []
    for f in t["faults"]:
        lo, hi = _window(f, t)
        start = max(f["start_ns"], t["attached_ns"])

        def first(pred):
            e = next((e for e in events if lo <= e["time_ns"] < hi and pred(e)), None)
            return None if e is None else round((e["time_ns"] - start) / 1e9, 2)
        faults.append({
            "kind": f["kind"], "rank": f["rank"], "before_attach": f["start_ns"] < t["attached_ns"],
            "slowdown_s": first(lambda e: e["kind"] == "slowdown" and e["scope"] == "job"),
            "passive_s": first(lambda e: e["kind"] == "diagnosis" and e["evidence"] == "passive"
                               and right(e, f)),
            "validated_s": first(lambda e: e["kind"] == "diagnosis"
                                 and e["evidence"] == "validation" and right(e, f))})
    alarms = [e for e in events if e["kind"] == "slowdown" and e["scope"] == "job"
              and _fault_at(t, e["onset_ns"]) is None]
    plans = [e for e in events if e["kind"] == "action" and e.get("strategy") != "none"
             and e.get("phase") != "outcome"]
    pauses = [e for e in events if e["kind"] == "activity" and e["what"] == "pause"
              and e["end_ns"] is not None]
    ranks = sorted({e["rank"] for e in events if e["kind"] == "iteration"},
                   key=lambda r: (r is None, r))
    return {
        "name": t["name"], "split": t["split"], "faults": faults,
        "right": len(rightv), "wrong": len(wrong), "wrong_verdicts": wrong,
        "unknown": sum(e["kind"] == "diagnosis" and e["cause"] == "unknown" for e in events),
        "false_slowdowns": len(alarms),
        "unconfirmed_slowdowns": sum(not confirmed(t, e) for e in alarms),
        "plans_in_fault": sum(_fault_at(t, e["time_ns"]) is not None for e in plans),
        "plans_outside": sum(_fault_at(t, e["time_ns"]) is None for e in plans),
        "gains": [round(1 - e["expected_ms"] / e["current_ms"], 3) for e in plans
                  if e.get("expected_ms") and e.get("current_ms")],
        "validations": sum(e["kind"] == "validation" and e["phase"] == "request"
                           for e in events),
        "paused_s": round(sum((e["end_ns"] - e["start_ns"]) / 1e9 for e in pauses), 2),
        "ranks": ranks,
        "seconds": round((t["end_ns"] - t["attached_ns"]) / 1e9, 1),
    }
