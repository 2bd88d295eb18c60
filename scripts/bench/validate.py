"""`greyhound-trace validate` of a running 4-rank gloo job (the demo's, on
this host's cores), its CPU workers as they are (NumPy and TCP sockets)
against PyTorch's own (`GH_VAL_WORKER=torch`: gloo send/recv, torch GEMMs,
what they were), alternated in one run on the same job. Per validation:

- wall time of the whole command, and the job's time paused;
- CPU seconds of the command and its workers;
- what the command cost the job while it ran but did not pause it (its
  own start and its workers' beside the job), from the job's own log: the
  mean iteration then against the 5 s before, in %, and as time lost (that
  excess over the iterations it covered: a short start-up at +10% costs
  less than a long one at +3%);
- the figures each measured: the slowest link's round trip over the
  fastest's (a healthy job: near 1), by the 10th percentile of each edge's
  round trips that the verdict uses and, beside it, by each edge's single
  fastest round trip (what it used before); and the verdict (must say
  nothing).

    sudo scripts/bench_validate                  # 5 rounds, ~4 minutes
    sudo scripts/bench_validate --rounds 9
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from harness import DEMO_ARGS, GREYHOUND, DDPJob, wait_for  # noqa: E402

KINDS = ("numpy", "torch")


def iterations_ms(truth: list[dict], lo: int, hi: int, away=()) -> list[float]:
    """Rank 0's iterations that start in [lo, hi) and overlap no span of `away`."""
    return [r["dur_ns"] / 1e6 for r in truth if r.get("rank") == 0 and lo <= r["start_ns"] < hi
            and not any(r["start_ns"] < b and r["start_ns"] + r["dur_ns"] > a for a, b in away)]


def one(job: DDPJob, kind: str, out: Path) -> dict:
    env = dict(os.environ, GH_VAL_WORKER=kind)
    time.sleep(5)                                    # the "before" window
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time_ns()
    r = subprocess.run([*GREYHOUND, "validate", str(job.pid), "-o", str(out)], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    t1 = time.time_ns()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in (0, 3):
        raise SystemExit(f"bench_validate: validate failed ({kind}): {r.stderr.strip()[-500:]}")
    ev = json.loads(out.read_text().splitlines()[-1])
    d = ev["details"]
    time.sleep(1)
    truth = job.truth_records()
    # The pause is what every kind costs alike; the start-up beside the job
    # is what differs: the iterations from the command's start to the
    # pause's (measuring begins with it), none that reaches into the pause.
    paused_at = int(d["measured_at_ns"])
    base = statistics.mean(iterations_ms(truth, t0 - int(5e9), t0))
    during = iterations_ms(truth, t0, paused_at, [(paused_at, t1)])
    rtts = [x["rtt_ms"] for x in d["links"].values()]
    fastest = [x["rtt_min_ms"] for x in d["links"].values()]
    return {"wall_s": (t1 - t0) / 1e9, "paused_s": d["paused_s"],
            "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "slower_pct": (statistics.mean(during) / base - 1) * 100,
            "lost_s": (sum(during) - base * len(during)) / 1e3,
            "link_spread": max(rtts) / min(rtts),
            "link_spread_min": max(fastest) / min(fastest),
            "verdict": ev["cause"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_validate: needs root: run it with sudo", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="greyhound-bench-validate."))
    job = DDPJob(work, 4, *DEMO_ARGS, name="job")
    got: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        job.trained(40, 180)
        for i in range(args.rounds):
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                res = one(job, kind, work / f"{kind}{i}.jsonl")
                got[kind].append(res)
                print(f"round {i + 1}/{args.rounds} {kind:5}: {res['wall_s']:5.1f} s, paused "
                      f"{res['paused_s']:.2f} s, {res['cpu_s']:5.1f} CPU s, job "
                      f"{res['slower_pct']:+5.1f}% ({res['lost_s']:+.2f} s) while it started, "
                      f"links x{res['link_spread']:.2f} (fastest round trips "
                      f"x{res['link_spread_min']:.2f}), {res['verdict']}", flush=True)
    except KeyboardInterrupt:
        print("bench_validate: interrupted", file=sys.stderr)
        return 130
    finally:
        job.close()
    def med(kind, key):
        return statistics.median(r[key] for r in got[kind])
    print(f"\nmedians over {args.rounds} validations each (4 ranks, {os.cpu_count()} CPUs):")
    print(f"{'':24}{'numpy':>10}{'torch':>10}{'ratio':>8}")
    for key, what in (("wall_s", "wall s"), ("paused_s", "paused s"), ("cpu_s", "CPU s"),
                      ("slower_pct", "job slower while starting %"),
                      ("lost_s", "job time lost then, s"),
                      ("link_spread", "slowest/fastest link"),
                      ("link_spread_min", "the same, by min rtt")):
        a, b = med("numpy", key), med("torch", key)
        ratio = f"{a / b:8.2f}" if key in ("wall_s", "cpu_s") and b else ""
        print(f"{what:24}{a:10.2f}{b:10.2f}{ratio}")
    named = [r["verdict"] for k in KINDS for r in got[k] if r["verdict"] != "unknown"]
    print(f"verdicts naming a cause on this healthy job: {len(named)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
