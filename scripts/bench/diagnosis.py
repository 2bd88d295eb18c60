"""Diagnosis accuracy and speed over injected scenarios on a real job.

A 4-rank PyTorch DDP job on gloo runs with every rank in its own network
namespace (veth pairs to one bridge: tests/netbed.py), under
`greyhound-trace attach` with its defaults (passive diagnosis, then
validation) but `--pause-budget 1`: 20 faults in 15 minutes would exhaust
the default budget (1% of any 10 minutes), and this bench measures the
verdicts (scripts/bench_soak measures the budget). After a healthy phase (which counts for false diagnoses), each
scenario picks a random rank, a random kind and a random onset:

- compute: the rank gets half the CPU it was using (a CFS quota, cgroup v1 or v2);
- link: the host side of the rank's veth is rate-limited (tc tbf, 400mbit).

The fault lasts until a validated diagnosis arrives (or --timeout), then is
lifted, and the job gets time to recover before the next one. Reported:

- correct rank and cause by validation (goal >= 95%), and by passive
  evidence (for comparison; passive evidence cannot name a link);
- false diagnoses: any verdict other than `unknown` outside a scenario;
- time from onset to the validated diagnosis (goal: median < 15 s);
- the longest pause of the job for validation (goal <= 5 s).
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from harness import JsonlTail, cpu_share, read_jsonl, wait_for  # noqa: E402
from netbed import NetBed  # noqa: E402

from greyhound_bpf.inject import CpuQuota, LinkRate  # noqa: E402

BIN = Path(sys.executable).parent
TRAIN = ("--microbatches", "2", "--mb-size", "64", "--hidden", "512", "--layers", "4",
         "--bucket-mb", "1")


def measured_after(d: dict, onset: int) -> bool:
    """A validation that began measuring before the fault measured the
    healthy job (or half of each): it is not this scenario's verdict."""
    at = d["details"].get("measured_at_ns")
    return at is not None and at > onset


def correct(d: dict | None, kind: str, rank: int) -> bool:
    if not d:
        return False
    if kind == "compute":
        return d["cause"] == "computation" and d["ranks"] == [rank]
    if d["evidence"] == "passive":     # passive evidence can say communication, not the link
        return d["cause"] == "communication"
    return d["cause"] == "communication" and d["link"] == f"rank {rank}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--healthy", type=float, default=60.0,
                   help="seconds of healthy job first (false diagnoses)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="longest wait for a validated diagnosis per scenario")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="greyhound-bench-diagnosis."))
    truth, events_path = work / "truth.jsonl", work / "events.jsonl"
    log = open(work / "tracer.log", "w")
    bed = NetBed(4, prefix="ghd")
    rows, windows = [], []
    tracer = None
    with bed:
        pids = bed.start_ranks(truth, *TRAIN, port=29755)
        wait_for(lambda: len(read_jsonl(truth)) >= 40, 180, "the job to train")
        # 20 faults in 15 minutes: the default pause budget (1% of any 10
        # minutes) would defer most validations, and this bench measures
        # the verdicts (bench_soak measures the budget on a healthy job).
        tracer = subprocess.Popen([str(BIN / "greyhound-trace"), "attach", *map(str, pids),
                                   "-o", str(events_path), "-q", "--pause-budget", "1"],
                                  stdout=log, stderr=subprocess.STDOUT)
        ev = JsonlTail(events_path)
        try:
            wait_for(lambda: any(e["kind"] == "iteration" for e in ev.read()), 120,
                       "the tracer's first iteration")
            print(f"bench_diagnosis: healthy for {args.healthy:.0f} s", flush=True)
            time.sleep(args.healthy)
            for i in range(args.scenarios):
                kind, rank = rng.choice(["compute", "link"]), rng.randrange(4)
                gap = rng.uniform(8, 20)
                share = cpu_share(pids[rank], gap)
                fault = (CpuQuota(pids[rank], max(0.01, share / 2)) if kind == "compute"
                         else LinkRate(bed.host_dev(rank), "400mbit"))
                onset = time.time_ns()
                fault.apply()
                try:
                    def validated():
                        return [e for e in ev.read() if e["kind"] == "diagnosis"
                                and e["evidence"] == "validation" and e["cause"] != "unknown"
                                and measured_after(e, onset)]
                    deadline = time.monotonic() + args.timeout
                    while time.monotonic() < deadline and not validated():
                        time.sleep(0.25)
                finally:
                    fault.undo()
                lifted = time.time_ns()
                diags = [e for e in ev.read() if e["kind"] == "diagnosis" and e["time_ns"] > onset]
                val = next((e for e in diags if e["evidence"] == "validation"
                            and e["cause"] != "unknown" and measured_after(e, onset)), None)
                pas = next((e for e in diags if e["evidence"] == "passive"
                            and e["cause"] != "unknown"), None)
                row = {"i": i, "kind": kind, "rank": rank, "validated": val, "passive": pas,
                       "ok": correct(val, kind, rank), "passive_ok": correct(pas, kind, rank),
                       "delay_s": (val["time_ns"] - onset) / 1e9 if val else None}
                rows.append(row)
                v = (f"{val['cause']} {val.get('link') or val['ranks']}" if val else "none")
                print(f"  {i + 1:2d}/{args.scenarios} {kind:7s} rank {rank}: validated {v} "
                      f"({'ok' if row['ok'] else 'WRONG'})"
                      + (f" after {row['delay_s']:.1f} s" if val else ""), flush=True)
                time.sleep(10)                # recovery before the next one
                windows.append((onset, time.time_ns()))
                del lifted
        finally:
            tracer.terminate()
            tracer.wait(60)
    evs = ev.all
    pauses = [e["details"]["paused_s"] for e in evs if e["kind"] == "diagnosis"
              and e["evidence"] == "validation" and "paused_s" in e.get("details", {})]
    false = [e for e in evs if e["kind"] == "diagnosis" and e["cause"] != "unknown"
             and not any(a <= e["time_ns"] <= b for a, b in windows)]
    n = len(rows)
    ok = sum(r["ok"] for r in rows)
    pok = sum(r["passive_ok"] for r in rows)
    delays = [r["delay_s"] for r in rows if r["delay_s"] is not None]
    med = statistics.median(delays) if delays else float("nan")
    print()
    print("| what | result | goal |")
    print("| --- | --- | --- |")
    print(f"| correct rank and cause, validated | {ok}/{n} ({100 * ok / n:.0f}%) | >= 95% |")
    print(f"| correct cause (and rank for compute), passive | {pok}/{n} ({100 * pok / n:.0f}%) | - |")
    print(f"| false diagnoses outside the scenarios | {len(false)} | 0 |")
    print(f"| onset -> validated diagnosis, median (min-max) | {med:.1f} s "
          f"({min(delays, default=0):.1f}-{max(delays, default=0):.1f}) | < 15 s |")
    print(f"| job paused per validation, max (validations) | {max(pauses, default=0):.2f} s "
          f"({len(pauses)}) | <= 5 s |")
    for e in false:
        print(f"false: {e['evidence']} {e['cause']} {e['ranks']} {e.get('link')}: {e['reason']}")
    print(f"(events in {events_path})")
    good = ok >= 0.95 * n and not false and med < 15 and max(pauses, default=0) <= 5
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
