#!/usr/bin/env python3
"""Record a scenario of the corpus (tests/scenarios/corpus.toml) for real.

A real gloo DDP job (scripts/demo_train.py or scripts/user_train.py, under
torchrun, or one rank per network namespace for link faults) runs under
`greyhound-trace attach --record`, advise-only, while the scenario's faults
are injected for real: a CFS quota on a rank (a share of the CPU it was
using), or a tbf rate limit on its veth. It writes, next to corpus.toml:

    NAME.rec.gz       every input of the analysis (greyhound_bpf.recording)
    NAME.truth.json   what was done and when: the faults (rank, kind, start and
                      end on the analysis clock), the attach time, the job's own
                      iteration times (rank 0, start to start), the scenario's
                      expectations and split (tune / heldout)

and checks that replaying the recording gives the live run's events. A
recording whose job log shows the host disturbed it outside the faults is
kept (that is the host), and its truth says so.

    sudo .venv/bin/python scripts/record_scenario.py compute-demo4-r2
    sudo .venv/bin/python scripts/record_scenario.py --all --split heldout
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import (DEMO_ARGS, DDPJob, GREYHOUND, JsonlTail, cpu_share,  # noqa: E402
                     read_jsonl, wait_for)
from netbed import NetBed  # noqa: E402

CORPUS = ROOT / "tests" / "scenarios"
ANALYSIS_KINDS = {"pattern", "iteration", "slowdown", "recovery", "diagnosis", "action",
                  "applied", "topology", "validation", "activity"}


def load_corpus() -> dict[str, dict]:
    with open(CORPUS / "corpus.toml", "rb") as fh:
        raw = tomllib.load(fh)
    return {s["name"]: s for s in raw["scenario"]}


def say(msg: str) -> None:
    print(f"record_scenario: {msg}", flush=True)


def trainer_args(sc: dict, ctl: Path | None) -> list[str]:
    args = (list(DEMO_ARGS) if sc["trainer"] == "demo" else
            ["--workers", str(sc.get("workers", 2))] if sc["trainer"] == "user" else [])
    if ctl is not None:
        args += ["--control-file", str(ctl)]
    return args + [str(a) for a in sc.get("args", [])]


class Fault:
    def __init__(self, spec: dict, pid: int, bed: NetBed | None):
        from greyhound_bpf.inject import CpuQuota, LinkRate
        self.spec, self.pid = spec, pid
        if spec["kind"] == "compute":
            self.used = cpu_share(pid, 2.0)
            self.quota = max(0.02, self.used * spec["share"])
            self.fault = CpuQuota(pid, self.quota, period_ms=spec.get("period_ms"))
        else:
            self.fault = LinkRate(bed.host_dev(spec["rank"]), spec["rate"])
        self.start_ns = self.end_ns = None

    def apply(self, clock) -> None:
        self.fault.apply()
        self.start_ns = clock()

    def undo(self, clock) -> None:
        if self.start_ns is not None and self.end_ns is None:
            self.fault.undo()
            self.end_ns = clock()

    def truth(self) -> dict:
        d = {"kind": self.spec["kind"], "rank": self.spec["rank"],
             "start_ns": self.start_ns, "end_ns": self.end_ns}
        if self.spec["kind"] == "compute":
            d.update(share=self.spec["share"], used_cpus=round(self.used, 3),
                     quota_cpus=round(self.quota, 3))
            if "period_ms" in self.spec:
                d["period_ms"] = self.spec["period_ms"]
        else:
            d.update(rate=self.spec["rate"])
        return d


def job_log(truth_path: Path, t0_ns: int) -> list[list[float]]:
    """Rank 0's iterations from the trainer's own log: [ms since t0, ms
    start to start] (corpus.job_log of rank 0 alone, rounded)."""
    import corpus
    rows = corpus.job_log([r for r in read_jsonl(truth_path) if r.get("rank") == 0],
                          t0_ns)["job_log"]
    return [[round(at, 1), round(ms, 2)] for at, ms in rows]


def record(sc: dict, out_dir: Path, work: Path) -> dict:
    name = sc["name"]
    rec, events = out_dir / f"{name}.rec.gz", work / "events.jsonl"
    ctl = work / "ctl.json" if sc.get("control") else None
    # The wall clock: the tracer's analysis clock is monotonic shifted to it
    # once, which on one machine agrees to well within an iteration.
    clock = time.time_ns
    bed = job = None
    faults: list[Fault] = []
    tracer = None
    try:
        if sc.get("netns"):
            bed = NetBed(sc["nproc"], prefix="ghs").__enter__()
            truth = work / "truth.jsonl"
            pids = bed.start_ranks(truth, *trainer_args(sc, ctl), "--steps", "0",
                                   port=29833, trainer=sc["trainer"])
            wait_for(lambda: len(read_jsonl(truth)) >= 30 * sc["nproc"], 180,
                     "the job to train", interval=0.5)
            roots = pids
            ranks = dict(enumerate(pids))
        else:
            job = DDPJob(work, sc["nproc"], *trainer_args(sc, ctl), trainer=sc["trainer"],
                         name="job")
            truth = job.truth
            ranks = job.ranks(sc["nproc"])
            job.trained(30 * sc["nproc"], 180)
            roots = [job.pid]
        time.sleep(sc.get("warm_s", 5))
        for spec in sc.get("fault", []):
            faults.append(Fault(spec, ranks[spec["rank"]], bed))
        before = [f for f in faults if f.spec["at_s"] < 0]
        for f in before:
            f.apply(clock)
        if before:
            time.sleep(-min(f.spec["at_s"] for f in before))
        cmd = [*GREYHOUND, "attach", *map(str, roots), "--record", str(rec),
               "-o", str(events), "-q"]
        if ctl is not None:
            cmd += ["--control-file", str(ctl)]
        log = open(work / "tracer.out", "w")
        begin_ns = clock()
        tracer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        tail = JsonlTail(events)
        wait_for(lambda: sum(len(e["ranks"]) for e in tail.kind("attach")) >= sc["nproc"], 60,
                 "the tracer to attach")
        attached_ns = tail.kind("attach")[0]["time_ns"]
        say(f"{name}: attached")
        t0 = time.monotonic()
        todo = sorted([(f.spec["at_s"], "apply", f) for f in faults if f.spec["at_s"] >= 0]
                      + [(f.spec["at_s"] + f.spec["for_s"], "undo", f) for f in faults
                         if "for_s" in f.spec], key=lambda x: x[0])
        for at, what, f in todo:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))
            getattr(f, what)(clock)
            say(f"{name}: {what} {f.spec['kind']} on rank {f.spec['rank']} at +{at:.0f} s")
        time.sleep(max(0.0, sc["duration_s"] - (time.monotonic() - t0)))
        for f in faults:
            f.undo(clock)
        end_ns = clock()
        tracer.send_signal(signal.SIGINT)
        tracer.wait(60)
        tracer = None
    finally:
        for f in faults:
            try:
                f.undo(clock)
            except Exception:
                pass
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
        if job is not None:
            job.close()
        if bed is not None:
            bed.__exit__(None, None, None)
    live = [e for e in read_jsonl(events) if e["kind"] in ANALYSIS_KINDS]
    from greyhound_bpf.replay import replay
    again = replay(str(rec))
    if again != live:
        raise SystemExit(f"record_scenario: {name}: the replay differs from the live run "
                         f"({len(again)} events against {len(live)})")
    t0_ns = begin_ns - int(10e9)
    doc = {"name": name, "split": sc["split"], "trainer": sc["trainer"],
           "nproc": sc["nproc"], "netns": bool(sc.get("netns")),
           "attach_begin_ns": begin_ns, "attached_ns": attached_ns, "end_ns": end_ns,
           "faults": [f.truth() for f in faults], "expect": sc.get("expect", {}),
           "note": sc.get("note", ""), "job_log_t0_ns": t0_ns,
           "job_log": job_log(truth, t0_ns),
           "recorded": {"events": len(live), "bytes": rec.stat().st_size,
                        "commit": _commit()}}
    write_truth(out_dir / f"{name}.truth.json", doc)
    return doc


def write_truth(path: Path, doc: dict) -> None:
    """Indented, but the job's log (a long list of pairs) on one line."""
    head = json.dumps({k: v for k, v in doc.items() if k != "job_log"}, indent=1)
    log = json.dumps(doc["job_log"], separators=(",", ":"))
    path.write_text(head[:-2] + f',\n "job_log": {log}\n}}\n')


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=ROOT)
    return r.stdout.strip() or "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="scenarios to record (corpus.toml names)")
    p.add_argument("--all", action="store_true", help="every scenario (of --split)")
    p.add_argument("--split", choices=("tune", "heldout"))
    p.add_argument("--out", type=Path, default=CORPUS, help="where to write (default: the corpus)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("record_scenario: needs root (BPF, cgroups, namespaces)", file=sys.stderr)
        return 1
    corpus = load_corpus()
    names = [n for n, s in corpus.items() if not args.split or s["split"] == args.split] \
        if args.all else args.names
    unknown = [n for n in names if n not in corpus]
    if unknown or not names:
        print(f"record_scenario: unknown scenario(s) {unknown}; known: {', '.join(corpus)}",
              file=sys.stderr)
        return 2
    for n in names:
        work = Path(tempfile.mkdtemp(prefix=f"greyhound-scenario-{n}."))
        say(f"{n}: recording ({work})")
        doc = record(corpus[n], args.out, work)
        say(f"{n}: {doc['recorded']['events']} events, {doc['recorded']['bytes'] / 1e3:.0f} KB; "
            "the replay gives the live run's events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
