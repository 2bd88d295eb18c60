"""What attaching costs a running job, from the job's own log.

Pairs of runs of the same real job (scripts/user_train.py under torchrun,
3 ranks on this 2-core VM: the CPU is saturated, as in the report that
asked for this), interleaved: in one Greyhound attaches with its defaults
at t0, in the other nothing does. Each run's iteration times (rank 0, start
to start, from its own log) in 2 s windows after t0 are compared with the
same run's 10 s before t0. A window's excess is its median over that
baseline, minus 1.

Reported per pair and as medians: the worst window's excess attached and
not (the machine's own noise), their difference (what attaching costs in
the worst window; goal <= 2%), the same over the whole observed span, and
the tracer's CPU seconds (start-up and steady state).

    sudo scripts/bench_attach                # 3 pairs, 30 s after t0
    sudo scripts/bench_attach --pairs 5 --trainer demo --nproc 4
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from harness import GREYHOUND, DDPJob, JsonlTail, cpu_seconds, wait_for  # noqa: E402

WINDOW_S = 2.0


def periods(truth: list[dict]) -> list[tuple[int, float]]:
    starts = sorted(r["start_ns"] for r in truth if r.get("rank") == 0 and "start_ns" in r)
    return [(a, (b - a) / 1e6) for a, b in zip(starts, starts[1:])]


def one_run(work: Path, attach: bool, args) -> dict:
    job = DDPJob(work, args.nproc, *(["--workers", "1"] if args.trainer == "user" else []),
                 trainer=args.trainer, name="job")
    tracer = None
    try:
        job.ranks(args.nproc)
        job.trained(40, 180)
        time.sleep(args.warm)
        t0 = time.time_ns()
        if attach:
            events = work / "events.jsonl"
            tracer = subprocess.Popen([*GREYHOUND, "attach", str(job.pid), "-o", str(events),
                                       "-q"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, cwd=ROOT)
            tail = JsonlTail(events)
            wait_for(lambda: tail.kind("attach"), 60, "the attach")
            attached_s = (time.time_ns() - t0) / 1e9
        time.sleep(args.observe)
        cpu = None
        if tracer is not None:
            cpu = cpu_seconds(tracer.pid)
            tracer.send_signal(signal.SIGINT)
            tracer.wait(60)
        p = periods(job.truth_records())
    finally:
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
        job.close()
    base = [ms for a, ms in p if t0 - 10e9 <= a < t0]
    ref = statistics.median(base)
    wins = []
    w = t0
    while w < t0 + args.observe * 1e9:
        ms = [m for a, m in p if w <= a < w + WINDOW_S * 1e9]
        if len(ms) >= 3:
            wins.append(statistics.median(ms) / ref - 1)
        w += int(WINDOW_S * 1e9)
    span = [m for a, m in p if t0 <= a < t0 + args.observe * 1e9]
    return {"worst": max(wins), "mean": statistics.median(span) / ref - 1, "ref_ms": ref,
            "windows": wins, "tracer_cpu_s": cpu,
            "attached_s": attached_s if attach else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--trainer", choices=("user", "demo"), default="user")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--warm", type=float, default=12.0, help="seconds of job before t0")
    p.add_argument("--observe", type=float, default=30.0, help="seconds observed after t0")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_attach: needs root (BPF): sudo scripts/bench_attach", file=sys.stderr)
        return 1
    rows = []
    for i in range(args.pairs):
        pair = {}
        for attach in ((True, False) if i % 2 == 0 else (False, True)):
            work = Path(tempfile.mkdtemp(prefix="greyhound-bench-attach."))
            try:
                pair["attach" if attach else "control"] = one_run(work, attach, args)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        a, c = pair["attach"], pair["control"]
        rows.append(pair)
        print(f"pair {i + 1}/{args.pairs}: worst {WINDOW_S:.0f} s window attached "
              f"{a['worst']:+.1%}, not attached {c['worst']:+.1%} (difference "
              f"{a['worst'] - c['worst']:+.1%}); whole {args.observe:.0f} s {a['mean']:+.1%} / "
              f"{c['mean']:+.1%}; probes in after {a['attached_s']:.1f} s; tracer "
              f"{a['tracer_cpu_s']:.1f} CPU s", flush=True)
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    worst = med(lambda r: r["attach"]["worst"] - r["control"]["worst"])
    print(f"\nmedian of {len(rows)} pairs ({args.nproc} {args.trainer} ranks, iteration "
          f"{med(lambda r: r['control']['ref_ms']):.1f} ms): worst {WINDOW_S:.0f} s window "
          f"attached {med(lambda r: r['attach']['worst']):+.1%}, not attached "
          f"{med(lambda r: r['control']['worst']):+.1%}: attaching costs {worst:+.1%} "
          f"(goal <= +2.0%: {'met' if worst <= 0.02 else 'NOT met'}); over "
          f"{args.observe:.0f} s {med(lambda r: r['attach']['mean'] - r['control']['mean']):+.1%}"
          f"; tracer {med(lambda r: r['attach']['tracer_cpu_s']):.1f} CPU s in "
          f"{args.observe:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
