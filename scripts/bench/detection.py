"""Detection quality of the streaming engine on seeded synthetic data.

- iteration-time error of IterationEstimator against the generator's truth,
  for periods 2..500, with and without 2% inserted/dropped calls;
- detection delay of SlowdownDetector for 20% and 10% slowdowns at CV 5%;
- false alarms over 10,000 healthy iterations at CV 5% with occasional
  one-iteration 3x spikes;
- recoveries reported as `recovery`, never as `slowdown`;
- short, noisy slow stretches (x1.2-1.5, 20-120 iterations, 10-30% noise)
  followed by the healthy level for good: series left stuck `slow`; and
  persistent slowdowns (x1.15-2) wrongly ended by a `recovery`.
Optionally (--truth FILE --trace FILE) the error on a real gloo DDP job.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from greyhound_bpf.engine.datasets import call_stream, iteration_series  # noqa: E402
from greyhound_bpf.engine import IterationEstimator, IterationRecord, SlowdownDetector  # noqa: E402


def estimate(cs, batch: int = 1000) -> list[IterationRecord]:
    est = IterationEstimator()
    out = []
    for i in range(0, len(cs.types), batch):
        out += [o for o in est.feed(cs.types[i:i + batch], cs.start_ns[i:i + batch],
                                    cs.dur_ns[i:i + batch], cs.blocking[i:i + batch])
                if isinstance(o, IterationRecord)]
    return out


def iteration_errors(starts_true, durs_true, recs) -> tuple[float, float]:
    """Median per-iteration relative error against the true iteration the
    record overlaps most, and the error of 10-iteration means."""
    idx = np.searchsorted(starts_true, [r.start_ns for r in recs], side="right") - 1
    per, est_d, true_d = [], [], []
    for r, i in zip(recs, idx):
        if 0 <= i < len(durs_true):
            # The record runs from an anchor inside iteration i to the same
            # anchor of i+1: it overlaps i+1 more if it starts past i's middle.
            j = i + 1 if r.start_ns - starts_true[i] > durs_true[i] / 2 and i + 1 < len(durs_true) else i
            per.append(abs(r.dur_ns - durs_true[j]) / durs_true[j])
            est_d.append(r.dur_ns)
            true_d.append(durs_true[j])
    win = [abs(sum(est_d[k:k + 10]) - sum(true_d[k:k + 10])) / sum(true_d[k:k + 10])
           for k in range(0, len(est_d) - 9, 10)]
    return (statistics.median(per) if per else float("nan"),
            statistics.median(win) if win else float("nan"))


def delays(factor: float, cv: float, seeds: int, onset: int = 200, n: int = 400) -> list[int | None]:
    out = []
    for seed in range(seeds):
        x, _ = iteration_series(n, changes=((onset, factor),), cv=cv, seed=seed)
        d = SlowdownDetector()
        found = None
        for t, v in enumerate(x):
            cp = d.update(v)
            if cp and cp.kind == "slowdown" and t >= onset:
                found = t - onset
                break
            if cp and cp.kind == "slowdown":
                break          # a false alarm before the onset counts as a miss
        out.append(found)
    return out


def false_alarms(n: int, cv: float, spike_prob: float, seed: int) -> tuple[int, int]:
    x, _ = iteration_series(n, cv=cv, spike_prob=spike_prob, spike_factor=3.0, seed=seed)
    d = SlowdownDetector()
    alarms = [cp for cp in (d.update(v) for v in x) if cp]
    return sum(a.kind == "slowdown" for a in alarms), sum(a.kind == "recovery" for a in alarms)


def recoveries(seeds: int) -> tuple[int, int]:
    rec = wrong = 0
    for seed in range(seeds):
        x, _ = iteration_series(600, changes=((200, 1.3), (400, 1.0)), cv=0.05, seed=seed)
        d = SlowdownDetector()
        for t, v in enumerate(x):
            cp = d.update(v)
            if cp and t >= 400:
                rec += cp.kind == "recovery"
                wrong += cp.kind == "slowdown"
    return rec, wrong


def noisy_stretches() -> tuple[int, int, int, int]:
    """(series stuck slow, of how many; persistent slowdowns given a
    recovery, of how many)."""
    import itertools
    stuck = n = ended = m = 0
    for seed, cv, cv_slow, factor, length in itertools.product(
            range(6), (0.05, 0.1, 0.15), (0.1, 0.2, 0.3), (1.2, 1.3, 1.5), (20, 60, 120)):
        rng = np.random.default_rng(seed)
        x = np.r_[50 * np.exp(rng.normal(0, cv, 200)),
                  50 * factor * np.exp(rng.normal(0, cv_slow, length)),
                  50 * np.exp(rng.normal(0, cv, 800))]
        d = SlowdownDetector()
        for v in x:
            d.update(v)
        n += 1
        stuck += d.state == "slow"
    for seed, cv, cv_slow, factor in itertools.product(
            range(8), (0.05, 0.1, 0.15), (0.05, 0.1, 0.2, 0.3), (1.15, 1.2, 1.3, 1.5, 2.0)):
        rng = np.random.default_rng(seed)
        x = np.r_[50 * np.exp(rng.normal(0, cv, 200)),
                  50 * factor * np.exp(rng.normal(0, cv_slow, 1000))]
        d = SlowdownDetector()
        m += 1
        ended += any(cp is not None and cp.kind == "recovery" and t >= 200
                     for t, cp in enumerate(map(d.update, x)))
    return stuck, n, ended, m


def real_job(trace: str, truth: str) -> tuple[float, float]:
    from greyhound_bpf.replay import replay
    ev = replay(trace)
    tr = [json.loads(line) for line in open(truth)]
    errs = []
    for rank in sorted({e["rank"] for e in ev if e["kind"] == "iteration"}):
        # The trainer's own iteration is start to next start (its dur_ns
        # leaves out the loop's own logging between steps).
        st = sorted(d["start_ns"] for d in tr if d.get("rank") == rank and "dur_ns" in d)
        t = list(zip(st[:-1], np.diff(st)))
        recs = [IterationRecord(rank, e["index"], e["start_ns"], e["dur_ns"], e["period_calls"],
                                e["comm_ns"], e["compute_ns"])
                for e in ev if e["kind"] == "iteration" and e["rank"] == rank]
        errs.append(iteration_errors(np.array([s for s, _ in t]), np.array([d for _, d in t]), recs))
    return statistics.median(e[0] for e in errs), statistics.median(e[1] for e in errs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--healthy", type=int, default=10_000)
    ap.add_argument("--trace", help="a recording (attach -o FILE --calls) of a real job")
    ap.add_argument("--truth", help="that job's own per-iteration log")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    res: dict = {}
    t0 = time.time()
    print("iteration-time error (median per iteration / of 10-iteration means), CV 2%")
    print(f"{'period':>7} {'noise':>6} {'per-iter':>9} {'10-iter':>8} {'found':>7}")
    res["error"] = []
    for period in (2, 5, 20, 100, 500):
        for noise in (0.0, 0.02):
            cs = call_stream(period, n_iter=max(80, 10_000 // period), noise=noise, seed=period)
            recs = estimate(cs)
            e1, e10 = iteration_errors(cs.iter_start_ns, cs.iter_dur_ns, recs)
            found = len(recs) / len(cs.iter_dur_ns)
            res["error"].append({"period": period, "noise": noise, "per_iter": e1,
                                 "mean10": e10, "found": found})
            print(f"{period:>7} {noise:>6.0%} {e1:>9.2%} {e10:>8.2%} {found:>7.0%}")
    for factor, label in ((1.2, "20%"), (1.1, "10%")):
        d = delays(factor, 0.05, args.seeds)
        hit = [x for x in d if x is not None]
        res[f"delay_{label}"] = {"median": statistics.median(hit) if hit else None,
                                 "max": max(hit) if hit else None, "missed": len(d) - len(hit)}
        print(f"delay, {label} slowdown at CV 5% over {args.seeds} seeds: median "
              f"{res[f'delay_{label}']['median']}, max {res[f'delay_{label}']['max']}, "
              f"missed {len(d) - len(hit)}")
    fa = [false_alarms(args.healthy, 0.05, sp, seed) for sp, seed in ((0.0, 1), (0.01, 2))]
    res["false_alarms"] = {"gaussian": fa[0], "with_spikes": fa[1]}
    print(f"false alarms in {args.healthy} healthy iterations at CV 5%: "
          f"{fa[0][0]} slowdown(s), {fa[0][1]} recovery(ies); with 1% 3x spikes: "
          f"{fa[1][0]} slowdown(s), {fa[1][1]} recovery(ies)")
    rec, wrong = recoveries(args.seeds)
    res["recovery"] = {"recoveries": rec, "as_slowdown": wrong}
    print(f"30% slowdown lifted, {args.seeds} seeds: {rec} recovery events, {wrong} reported as slowdown")
    stuck, n, ended, m = noisy_stretches()
    res["noisy_stretches"] = {"stuck_slow": stuck, "series": n,
                              "persistent_ended": ended, "persistent": m}
    print(f"short noisy slow stretch, then healthy: {stuck} of {n} series stuck slow; "
          f"persistent slowdowns given a recovery: {ended} of {m}")
    if args.trace and args.truth:
        e1, e10 = real_job(args.trace, args.truth)
        res["real"] = {"per_iter": e1, "mean10": e10}
        print(f"real gloo DDP job: per-iteration error {e1:.2%}, 10-iteration means {e10:.2%}")
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
