"""S2 solver time at 8..8,192 data-parallel ranks, both sides in one run.

Ours: `mitigation.rebalance.solve` (cvxpy + HiGHS MIP, bounded by the greedy
water-filling split). Peer: the same MIP without those bounds (what a plain
cvxpy formulation does), under a time limit. Each case: 8 micro-batches per
rank, per-micro-batch times uniform in [1, 2] with one rank 2x slow.
Prints the median over seeds and the ratio peer/ours, and checks that both
reach the same makespan where the peer finishes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mitigation.rebalance import solve  # noqa: E402


def plain_mip(t: np.ndarray, total: int, limit: float) -> tuple[float, float, str]:
    import cvxpy as cp
    ts = t / t.max()
    n = cp.Variable(len(t), integer=True)
    T = cp.Variable()
    prob = cp.Problem(cp.Minimize(T), [cp.multiply(ts, n) <= T, cp.sum(n) == total, n >= 1])
    start = time.perf_counter()
    prob.solve(solver=cp.HIGHS, time_limit=limit)
    elapsed = time.perf_counter() - start
    makespan = float((np.rint(n.value) * t).max()) if n.value is not None else float("nan")
    return elapsed, makespan, prob.status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 512, 1024, 8192])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--limit", type=float, default=10.0, help="peer's time limit (s)")
    args = p.parse_args(argv)
    import warnings
    warnings.filterwarnings("ignore")
    solve([1.0, 2.0], 4)        # import cvxpy and HiGHS before timing
    print(f"{'ranks':>6} {'ours (s)':>10} {'plain MIP (s)':>14} {'ratio':>7}  same makespan")
    for w in args.ranks:
        ours, peer, same = [], [], []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            t = rng.uniform(1, 2, w)
            t[rng.integers(w)] *= 2
            r = solve(t, 8 * w)
            ours.append(r.solve_s)
            pe, pm, status = plain_mip(t, 8 * w, args.limit)
            peer.append(pe)
            same.append("yes" if abs(pm - r.makespan) <= 1e-9 * r.makespan
                        else f"no ({status}: {pm:.4g} vs {r.makespan:.4g})")
        mo, mp = statistics.median(ours), statistics.median(peer)
        capped = " (limit)" if max(peer) >= args.limit else ""
        print(f"{w:>6} {mo:>10.4f} {mp:>14.3f}{capped} {mp / mo:>6.0f}x  "
              f"{', '.join(sorted(set(same)))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
