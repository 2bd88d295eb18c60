"""S3 measured: a real pipeline-parallel job re-split by `attach --mitigate`,
with the real loss modelled (a slow stage's capacity is lost).

The job is scripts/pipeline_train.py: GPipe over gloo, 2 stages x 2
data-parallel replicas, 8 identical blocks, each rank pinned (stage 0's
ranks on one CPU, stage 1's on the other). The fault is a CFS quota on
rank 1 (stage 1, replica 0), as a slow GPU would be: the whole stage waits
for it.

Each round runs, in one run on one machine:
1. the sweep, without Greyhound: the job at the even split healthy, then at
   every layer split with rank 1 under the quota. It gives doing nothing
   (the even split, slowed), the ideal (the sweep's fastest split) and each
   split's true iteration time;
2. the mitigated job under greyhound-run: healthy for a while (asserted: no
   verdict, no plan), then the quota on rank 1; Greyhound's
   reconfigure_pipeline plan (its split and predicted iteration time);
   greyhound-run's relaunch with the new split and its measured restart
   cost; the same quota on the relaunched rank 1 (the slow device stays);
   the iteration time after, attached and then with Greyhound detached
   (what its probes and idle workers cost the re-split job), and
   Greyhound's own CPU (the tracer and its workers) in each phase.

It prints per round and as medians: healthy / slowed / re-split / ideal
iteration time (from the trainer's own log, start to start), the plan's
prediction against what its split measured (goal within 10%), the model's
prediction for every split against the sweep, the same for the model
before it (everything scaled with the stages' compute) on the same
figures, and how many seconds of fault the re-split needs to pay its
measured restart cost back.

    sudo scripts/bench_mitigation --pipeline              # 2 rounds, quota 0.15 CPU
    sudo scripts/bench_mitigation --pipeline --rounds 1 --quota 0.25
    sudo scripts/bench_mitigation --pipeline --keep    # logs and events kept, per round
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from harness import (BIN, Timeout, Tracer, free_port, kill_tree,  # noqa: E402
                     median_dur, mitigating_healthy, rank_pids, read_jsonl, tree_cpu_s,
                     wait_for)

from greyhound_bpf.inject import CpuQuota  # noqa: E402
from mitigation.resplit import predict_split  # noqa: E402

TRAINER = ROOT / "scripts" / "pipeline_train.py"
BLOCKS, STAGES, NPROC, SLOW_RANK = 8, 2, 4, 1
JOB = ("--pin", "--pp", str(STAGES), "--blocks", str(BLOCKS), "--hidden", "256",
       "--mb-size", "64", "--microbatches", "4")


def launch(work: Path, name: str, *extra: str, prefix: list[str] = (),
           env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    truth = work / f"truth-{name}.jsonl"
    cmd = [*prefix, str(BIN / "torchrun"), "--nproc-per-node", "{nproc}" if prefix else
           str(NPROC), "--master-port", str(free_port()), str(TRAINER), *JOB,
           "--truth", str(truth), *extra]
    p = subprocess.Popen(cmd, stdout=open(work / f"{name}.out", "w"), stderr=subprocess.STDOUT,
                         start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    return p, truth


def trained(truth: Path, rank: int, n: int, split: list[int] | None = None) -> int | None:
    """The start of the rank's n-th iteration (of `split` if given), or None."""
    recs = [d for d in read_jsonl(truth) if d.get("rank") == rank and "start_ns" in d
            and (split is None or d["layer_split"] == split)]
    return recs[n - 1]["start_ns"] if len(recs) >= n else None


def sweep_one(work: Path, split: list[int], quota: float | None, seconds: float) -> float:
    """The job's iteration time at `split`, rank 1 under the quota."""
    name = "healthy" if quota is None else "split-" + "-".join(map(str, split))
    p, truth = launch(work, name, env={"GREYHOUND_LAYER_SPLIT": ",".join(map(str, split))})
    q = None
    try:
        wait_for(lambda: trained(truth, SLOW_RANK, 3), 180, f"the job at {split} to train",
                 interval=0.2)
        if quota is not None:
            q = CpuQuota(rank_pids(p.pid)[SLOW_RANK], quota).apply()
        time.sleep(2)                            # the quota's first periods settle
        lo = time.time_ns()
        time.sleep(seconds)
        ms, n = median_dur(read_jsonl(truth), lo, time.time_ns())
        if n < 5:
            raise Timeout(f"only {n} iterations at {split} in {seconds:.0f} s")
        return ms
    finally:
        if q is not None:
            q.undo()
        kill_tree(p)


class CpuSampler(threading.Thread):
    """Greyhound's own CPU over time (the tracer and its validation workers),
    sampled every quarter second: what it takes from a job pinned to every core."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.25):
            self.samples.append((time.time_ns(), tree_cpu_s(self.pid)))

    def share(self, lo_ns: int, hi_ns: int) -> float:
        """CPUs used in [lo, hi) (1.0 is one CPU)."""
        s = [x for x in self.samples if lo_ns <= x[0] <= hi_ns]
        return (s[-1][1] - s[0][1]) / ((s[-1][0] - s[0][0]) / 1e9) if len(s) > 1 else float("nan")


def mitigated(work: Path, quota: float, args) -> dict:
    ctl = work / "ctl.json"
    sup = [str(BIN / "greyhound-run"), "--control-file", str(ctl), "--nproc", str(NPROC), "--"]
    p, truth = launch(work, "mitigated", "--control-file", str(ctl), "--checkpoint",
                      str(work / "ckpt"), prefix=sup)
    quotas, tracer, sampler = [], None, None

    def start_tracer(pids, *extra):
        nonlocal tracer, sampler
        tracer = Tracer(work, pids, *extra)
        sampler = CpuSampler(tracer.proc.pid)
        return tracer
    try:
        wait_for(lambda: trained(truth, SLOW_RANK, 3), 180, "the job to train", interval=0.2)
        first, t = mitigating_healthy(start_tracer, p.pid, NPROC, ctl, args.healthy,
                                      restart_cost=str(args.restart_cost))
        slow_ns = time.time_ns()
        quotas.append(CpuQuota(first[SLOW_RANK], quota).apply())
        plan = wait_for(lambda: next((e for e in t.events("action")
                                      if e["strategy"] == "reconfigure_pipeline"), None),
                        args.plan_within, "a re-split")
        split = plan["plan"]["layer_split"]
        wait_for(lambda: trained(truth, SLOW_RANK, 1, split), 180,
                 "the relaunched job to train", interval=0.2)
        second = rank_pids(p.pid)
        quotas.append(CpuQuota(second[SLOW_RANK], quota).apply())
        time.sleep(5)                 # the tracer attaches to the relaunched ranks
        after_ns = time.time_ns()
        time.sleep(args.measure)
        end_ns = time.time_ns()
        # The same job, the same quota, Greyhound detached: what the re-split
        # runs at without the tracer's own cost (its probes, its idle workers).
        tracer.stop()
        time.sleep(2)
        bare_ns = time.time_ns()
        time.sleep(args.measure)
        bare_end_ns = time.time_ns()
        cost = json.loads(Path(f"{ctl}.restart_cost").read_text())["restart_s"] \
            if Path(f"{ctl}.restart_cost").exists() else float("nan")
        recs = read_jsonl(truth)
    finally:
        for q in quotas:
            q.undo()
        if tracer is not None:
            tracer.stop()
            tracer.close()
        if sampler is not None:
            sampler.done.set()
            (work / "tracer_cpu.json").write_text(json.dumps(sampler.samples))
        kill_tree(p)
    old = [d for d in recs if d.get("layer_split") != split]
    # The iterations the policy's estimate held (its last 4 x 8 per rank).
    starts = sorted(d["start_ns"] for d in old if d.get("rank") == 0 and "start_ns" in d
                    and d["start_ns"] < plan["time_ns"])[-33:]
    return {"healthy_ms": median_dur(old, slow_ns - int(args.healthy * 1e9), slow_ns)[0],
            "slowed_ms": median_dur(old, slow_ns + int(2e9), plan["time_ns"])[0],
            "slowed_recent_ms": median_dur(old, starts[0], plan["time_ns"])[0],
            "after_ms": median_dur(recs, after_ns, end_ns)[0],
            "detached_ms": median_dur(recs, bare_ns, bare_end_ns)[0],
            "tracer_cpu": {"healthy": sampler.share(slow_ns - int(args.healthy * 1e9), slow_ns),
                           "after": sampler.share(after_ns, end_ns)},
            "split": split, "expected_ms": plan["expected_ms"],
            "plan_s": (plan["time_ns"] - slow_ns) / 1e9, "restart_s": cost,
            "decision_cost": plan.get("cost"), "stage_ms": plan.get("stage_ms"),
            "fixed_ms": plan.get("fixed_ms"), "compute_ms": plan.get("compute_ms"),
            "job_ms": plan.get("current_ms"), "microbatches": plan.get("microbatches")}


def one_round(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="greyhound-bench-pipeline."))
    try:
        splits = [[k, BLOCKS - k] for k in range(1, BLOCKS)]
        print(f"  sweep: healthy at {splits[BLOCKS // 2 - 1]}", flush=True)
        healthy = sweep_one(work, splits[BLOCKS // 2 - 1], None, args.measure)
        truth = {}
        for s in splits:
            truth[tuple(s)] = sweep_one(work, s, args.quota, args.measure)
            print(f"  sweep: {s} slowed {truth[tuple(s)]:.1f} ms", flush=True)
        print("  mitigated run", flush=True)
        m = mitigated(work, args.quota, args)
    finally:
        if args.keep:
            print(f"  kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    # The model (each stage's sends fixed, the rest growing with its layers)
    # and, on the same figures, the one before it (everything scaled with
    # the stages' compute), for every split the sweep ran.
    model, scaled = {}, {}
    if m["stage_ms"] and m["job_ms"]:
        for s in splits:
            now = splits[BLOCKS // 2 - 1]
            model[tuple(s)] = predict_split(m["stage_ms"], now, s, m["job_ms"],
                                            m["microbatches"], fixed=m["fixed_ms"])
            scaled[tuple(s)] = predict_split(m["compute_ms"], now, s, m["job_ms"],
                                             m["microbatches"])
    return {"healthy": healthy, "sweep": truth, "model": model, "scaled": scaled, **m}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quota", type=float, default=0.15, help="rank 1's CPU share while slow")
    p.add_argument("--healthy", type=float, default=10.0, help="healthy seconds, attached")
    p.add_argument("--measure", type=float, default=8.0, help="seconds measured per phase")
    p.add_argument("--restart-cost", type=float, default=5.0, metavar="S",
                   help="attach --restart-cost: the estimate before a restart was measured")
    p.add_argument("--plan-within", type=float, default=120.0, metavar="S")
    p.add_argument("--keep", action="store_true",
                   help="keep each round's work folder (the job's logs, the tracer's events)")
    p.add_argument("--save", metavar="FILE", help="write each round's figures here (JSON)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_mitigation --pipeline: needs root (BPF and cgroups)", file=sys.stderr)
        return 1
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", flush=True)
        r = one_round(args)
        rounds.append(r)
        ideal = min(r["sweep"], key=r["sweep"].get)
        got = r["sweep"].get(tuple(r["split"]), float("nan"))
        saving = r["slowed_ms"] - r["after_ms"]
        old = r["scaled"].get(tuple(r["split"]), float("nan"))
        r.update(ideal=ideal, vs_pred=r["after_ms"] / r["expected_ms"] - 1,
                 vs_scaled=r["after_ms"] / old - 1,
                 vs_sweep=got / r["expected_ms"] - 1,
                 pays_s=r["restart_s"] / (saving / r["slowed_ms"]) if saving > 0 else
                 float("inf"))
        print(f"round {i + 1}: healthy {r['healthy']:.1f} ms ({r['healthy_ms']:.1f} attached); "
              f"slowed (doing nothing) {r['sweep'][(4, 4)]:.1f} ms in the sweep, "
              f"{r['slowed_ms']:.1f} ms attached; "
              f"plan {r['split']} after {r['plan_s']:.1f} s (restart cost {r['decision_cost']}) "
              f"predicted {r['expected_ms']:.1f} ms, measured {r['after_ms']:.1f} ms "
              f"({r['vs_pred']:+.1%}; against everything scaled with the compute "
              f"{old:.1f} ms, {r['vs_scaled']:+.1%}; detached {r['detached_ms']:.1f} ms; "
              f"the sweep's "
              f"{got:.1f} ms, {r['vs_sweep']:+.1%}); ideal "
              f"{list(ideal)} at {r['sweep'][ideal]:.1f} ms; relaunch took {r['restart_s']:.1f} s,"
              f" paid back after {r['pays_s']:.0f} s of fault; Greyhound's CPU healthy "
              f"{r['tracer_cpu']['healthy']:.2f}, re-split {r['tracer_cpu']['after']:.2f}",
              flush=True)
        if args.save:
            Path(args.save).write_text(json.dumps(
                [{**x, "sweep": {str(list(k)): v for k, v in x["sweep"].items()},
                  "model": {str(list(k)): v for k, v in x["model"].items()},
                  "scaled": {str(list(k)): v for k, v in x["scaled"].items()},
                  "ideal": list(x["ideal"])} for x in rounds], indent=1))
        print(f"  stages' time at the plan {r['stage_ms']} ms growing with their layers, "
              f"{r['fixed_ms']} ms not, iteration "
              f"{r['job_ms']} ms (the trainer's last 32: {r['slowed_recent_ms']:.1f} ms), "
              f"{r['microbatches']} micro-batches")
        if r["model"]:
            print("  split    sweep    model   error   scaled   error")
            for s, ms in r["sweep"].items():
                pm, ps = r["model"].get(s, float("nan")), r["scaled"].get(s, float("nan"))
                print(f"  {str(list(s)):7s} {ms:7.1f} {pm:8.1f} {pm / ms - 1:+7.1%} "
                      f"{ps:8.1f} {ps / ms - 1:+7.1%}")
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    print(f"\nmedian of {len(rounds)} rounds (8 blocks, 2 stages x 2 replicas, rank "
          f"{SLOW_RANK} at {args.quota} CPU):")
    print(f"  healthy {med(lambda r: r['healthy']):.1f} ms; doing nothing "
          f"{med(lambda r: r['sweep'][(4, 4)]):.1f} ms; Greyhound's re-split "
          f"{med(lambda r: r['after_ms']):.1f} ms; ideal {med(lambda r: r['sweep'][r['ideal']]):.1f}"
          f" ms; same split as the ideal in {sum(tuple(r['split']) == r['ideal'] for r in rounds)}"
          f" of {len(rounds)}")
    def errors(model, off_slow=False):
        e = [abs(r[model][s] / ms - 1) for r in rounds if r[model]
             for s, ms in r["sweep"].items() if not off_slow or s[1] < s[0]]
        return f"{statistics.median(e):.1%}" if e else "nan"
    print(f"  measured vs predicted {med(lambda r: r['vs_pred']):+.1%} (goal within 10%), "
          f"against everything scaled with the compute {med(lambda r: r['vs_scaled']):+.1%}")
    print(f"  model error over the sweep's splits, median |e|: {errors('model')} "
          f"({errors('model', True)} on those with layers moved off the slow stage); "
          f"everything scaled {errors('scaled')} ({errors('scaled', True)})")
    print(f"  relaunch (restart cost) {med(lambda r: r['restart_s']):.1f} s, paid back after "
          f"{med(lambda r: r['pays_s']):.0f} s of fault")
    return 0


if __name__ == "__main__":
    sys.exit(main())
