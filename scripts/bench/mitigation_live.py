"""End-to-end mitigation on a real job: detect -> rebalance -> recover.

A 4-rank PyTorch DDP job on gloo (scripts/demo_train.py, 32 micro-batches
per iteration) runs under `greyhound-trace attach --mitigate`. After a
healthy phase one rank gets half the CPU it was using (a cgroup v1 CFS
quota: 2x slower), later the quota is lifted. Measured from the trainer's
own per-iteration log (ground truth, not the tool's estimate), as the period
between consecutive iteration starts:

- healthy, slow (before any plan is applied) and mitigated iteration times;
- the mitigated time against the solver's predicted optimum (the plan's
  expected_ms): goal within 10%;
- lost time recovered, (slow - mitigated) / (slow - healthy): goal >= 70%,
  and the same in throughput terms;
- whether the policy returns to the even split after the quota is lifted,
  and how long each milestone took.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from harness import (DEMO_ARGS, DDPJob, Timeout, cpu_share, median_dur,  # noqa: E402
                     rank_pids, read_jsonl, wait_for)
from greyhound_bpf.inject import CpuQuota  # noqa: E402

BIN = Path(sys.executable).parent


def one_run(work: Path, slow_rank: int, healthy_s: float, mitigated_s: float,
            after_s: float, log) -> dict:
    ctl, events = work / "ctl.json", work / "events.jsonl"
    job = DDPJob(work, 4, *DEMO_ARGS, "--control-file", str(ctl), name="job")
    truth = job.truth
    tracer = None
    quota = None
    try:
        pids = wait_for(lambda: len(rank_pids(job.pid)) == 4 and rank_pids(job.pid), 120,
                          "4 ranks")
        wait_for(lambda: len(read_jsonl(truth)) >= 40, 120, "the job to train")
        tracer = subprocess.Popen(
            [str(BIN / "greyhound-trace"), "attach", str(job.pid), "--control-file", str(ctl),
             "--mitigate", "--json", str(events), "-q"], stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: any(e["kind"] == "iteration" for e in read_jsonl(events)), 120,
                   "the tracer's first iteration")
        victim = pids[slow_rank]
        share = cpu_share(victim, healthy_s)
        inject_ns = time.time_ns()
        quota = CpuQuota(victim, max(0.01, share / 2)).apply()

        def applied_after(t_ns, pred):
            """The first plan made after t_ns that every rank applied."""
            evs = read_jsonl(events)
            for e in evs:
                if e["kind"] == "applied" and e["time_ns"] > t_ns:
                    plan = next((a for a in evs if a["kind"] == "action"
                                 and a.get("seq") == e["seq"] and "plan" in a), None)
                    if plan and plan["time_ns"] > t_ns and pred(plan):
                        return e, plan
            return None
        uneven = lambda a: len(set(a["plan"].get("microbatches", {}).values())) > 1  # noqa: E731
        even = lambda a: len(set(a["plan"].get("microbatches", {}).values())) == 1  # noqa: E731
        applied, plan = wait_for(lambda: applied_after(inject_ns, uneven), 120,
                                   "a rebalance to be applied")
        time.sleep(mitigated_s)
        lift_ns = time.time_ns()
        quota.undo()
        quota = None
        back = None
        try:
            back = wait_for(lambda: applied_after(lift_ns, even), after_s, "the even split")
        except Timeout:
            pass
        time.sleep(3)
        end_ns = time.time_ns()
    finally:
        if quota:
            quota.undo()
        if tracer and tracer.poll() is None:
            tracer.send_signal(signal.SIGINT)
            try:
                tracer.wait(30)
            except subprocess.TimeoutExpired:
                tracer.kill()
        job.close()
    tr = read_jsonl(truth)
    evs = read_jsonl(events)
    start_ns = min(e["time_ns"] for e in evs if e["kind"] == "iteration")
    slowdowns = [e for e in evs if e["kind"] == "slowdown" and e.get("scope") == "job"
                 and e["time_ns"] > inject_ns]
    healthy, nh = median_dur(tr, start_ns + int(2e9), inject_ns)
    slow, ns = median_dur(tr, inject_ns + int(0.3e9), applied["time_ns"] - int(0.2e9))
    mitigated, nm = median_dur(tr, applied["time_ns"] + int(2e9), lift_ns)
    recovered, nr = median_dur(tr, back[0]["time_ns"] + int(1e9), end_ns) if back else (None, 0)
    counts = {int(k): v for k, v in plan["plan"]["microbatches"].items()}
    # Each plan against its own prediction, over the iterations it ran.
    actions = {a["seq"]: a for a in evs if a["kind"] == "action" and a.get("seq")
               and "plan" in a}
    tenures = [e for e in evs if e["kind"] == "applied" and inject_ns < e["time_ns"] < lift_ns]
    per_plan = []
    for e, nxt in zip(tenures, tenures[1:] + [None]):
        hi = nxt["time_ns"] if nxt else lift_ns
        got, n = median_dur(tr, e["time_ns"] + int(0.5e9), hi)
        if n >= 10 and e["seq"] in actions:
            per_plan.append(got / actions[e["seq"]]["expected_ms"] - 1)
    return {
        "share": share, "healthy_ms": healthy, "slow_ms": slow, "mitigated_ms": mitigated,
        "expected_ms": plan["expected_ms"], "plan": counts, "samples": (nh, ns, nm),
        "detect_s": (slowdowns[0]["time_ns"] - inject_ns) / 1e9 if slowdowns else None,
        "applied_s": (applied["time_ns"] - inject_ns) / 1e9,
        "back_to_even_s": (back[0]["time_ns"] - lift_ns) / 1e9 if back else None,
        "recovered_ms": recovered,
        "vs_expected": statistics.median(per_plan) if per_plan else float("nan"),
        "plans_measured": len(per_plan),
        "plans": sum(1 for e in evs if e["kind"] == "action" and e.get("seq")
                     and "plan" in e),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--healthy", type=float, default=15.0, help="seconds before the slowdown")
    p.add_argument("--mitigated", type=float, default=20.0, help="seconds with the plan")
    p.add_argument("--after", type=float, default=60.0,
                   help="seconds to wait for the even split once the quota is lifted")
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_mitigation: needs root (BPF and cgroups): sudo scripts/bench_mitigation",
              file=sys.stderr)
        return 1
    rows = []
    for i in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="greyhound-bench-mitigation."))
        with open(work / "log.txt", "w") as log:
            print(f"run {i + 1}/{args.runs} ({work})", flush=True)
            r = one_run(work, args.slow_rank, args.healthy, args.mitigated, args.after, log)
        rows.append(r)
        rec_time = (r["slow_ms"] - r["mitigated_ms"]) / (r["slow_ms"] - r["healthy_ms"])
        thr = ((1 / r["mitigated_ms"] - 1 / r["slow_ms"])
               / (1 / r["healthy_ms"] - 1 / r["slow_ms"]))
        r["recovered_time"], r["recovered_throughput"] = rec_time, thr
        print(f"  rank {args.slow_rank} used {r['share']:.2f} CPU, quota {r['share'] / 2:.2f}; "
              f"iteration ms healthy {r['healthy_ms']:.1f}, slow {r['slow_ms']:.1f}, "
              f"mitigated {r['mitigated_ms']:.1f} (each plan vs its prediction: median "
              f"{r['vs_expected']:+.1%} over {r['plans_measured']}), after lift "
              f"{'-' if r['recovered_ms'] is None else format(r['recovered_ms'], '.1f')}")
        print(f"  plan {r['plan']}; detected {r['detect_s'] or float('nan'):.1f} s, applied "
              f"{r['applied_s']:.1f} s after the slowdown; even split "
              f"{'never' if r['back_to_even_s'] is None else format(r['back_to_even_s'], '.1f') + ' s'}"
              f" after the lift; {r['plans']} plans; samples {r['samples']}", flush=True)
        if not args.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    print()
    print(f"median of {len(rows)} runs (4 ranks, 32 micro-batches, rank {args.slow_rank} at "
          f"half its CPU):")
    print(f"  {'healthy ms':>12} {'slow ms':>9} {'mitigated':>10} "
          f"{'plan vs predicted':>18} {'recovered (time)':>17} {'(throughput)':>13}")
    print(f"  {med('healthy_ms'):>12.1f} {med('slow_ms'):>9.1f} {med('mitigated_ms'):>10.1f} "
          f"{med('vs_expected'):>+18.1%} "
          f"{med('recovered_time'):>17.0%} {med('recovered_throughput'):>13.0%}")
    back = [r["back_to_even_s"] for r in rows]
    print(f"  back to the even split after the lift: {sum(b is not None for b in back)}/"
          f"{len(rows)} runs"
          + (f", median {statistics.median(b for b in back if b is not None):.1f} s"
             if any(b is not None for b in back) else ""))
    print(f"  goals: within 10% of expected -> "
          f"{'met' if abs(med('vs_expected')) <= 0.10 else 'NOT met'}; >= 70% recovered -> "
          f"{'met' if med('recovered_time') >= 0.70 else 'NOT met'} (time), "
          f"{'met' if med('recovered_throughput') >= 0.70 else 'NOT met'} (throughput)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
