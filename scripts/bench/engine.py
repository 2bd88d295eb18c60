"""Speed of the streaming engine, each side by side with its peer in one run.

- ACF: ours (Numba) against statsmodels.tsa.stattools.acf on the same data:
  max abs difference and time ratio;
- BOCD: ours (pruned, Numba) against the unpruned NumPy reference in
  tests/bocd_reference.py, per update over a 10,000-point series (and the
  cost of an update at t = 10,000), plus agreement of their change points;
- the full per-rank pipeline: call records -> iterations -> detector, in
  call records per second on one core;
- the call-by-call cross-section (diagnosis/callcross.py) on the same
  kind of records, of a fast job (its pace gate closed: what every job
  with many collectives pays) and of a slow, sparse one (looking at each
  collective), in call records per second beside the pipeline's;
- cold start: first-run Numba compile time (empty cache) and a warm start,
  and a warm `greyhound-trace replay` of the recorded fixture.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bocd_reference import ReferenceBOCD, reference_changepoints  # noqa: E402
from greyhound_bpf.engine import _kernels  # noqa: E402
from greyhound_bpf.probe.catalog import load_catalog  # noqa: E402
from greyhound_bpf.engine.datasets import call_stream, iteration_series  # noqa: E402
from greyhound_bpf.engine import BOCD, changepoints, default_prior  # noqa: E402
from greyhound_bpf.engine.pipeline import JobPipeline  # noqa: E402


def best_of(fn, repeat=5):
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def bench_acf() -> dict:
    from statsmodels.tsa.stattools import acf as sm_acf
    rng = np.random.default_rng(0)
    x = rng.normal(size=4096) + np.sin(np.arange(4096) / 7)
    nlags = 500
    diff = max(float(np.max(np.abs(_kernels.acf(x, nlags) - sm_acf(x, nlags=nlags, fft=f))))
               for f in (False, True))
    ours = best_of(lambda: _kernels.acf(x, nlags), 9)
    sm = best_of(lambda: sm_acf(x, nlags=nlags, fft=False), 9)
    sm_fft = best_of(lambda: sm_acf(x, nlags=nlags, fft=True), 9)     # statsmodels' default
    return {"n": 4096, "nlags": nlags, "max_abs_diff": diff, "ours_ms": ours * 1e3,
            "statsmodels_ms": sm * 1e3, "statsmodels_fft_ms": sm_fft * 1e3,
            "speedup": sm / ours, "speedup_vs_fft": sm_fft / ours}


def time_updates(detector, x) -> tuple[float, float]:
    """Mean seconds per update over x, and the median of the last 100."""
    per = []
    t0 = time.perf_counter()
    for v in x:
        t = time.perf_counter()
        detector.update(v)
        per.append(time.perf_counter() - t)
    return (time.perf_counter() - t0) / len(x), statistics.median(per[-100:])


def bench_bocd(n: int = 10_000) -> dict:
    x = np.random.default_rng(1).normal(size=n)
    p = default_prior(x)
    ref_mean, ref_at_end = time_updates(ReferenceBOCD(0.01, **p), x)
    ours_mean, ours_at_end = time_updates(BOCD(hazard=0.01, **p), x)
    agree = 0
    cases = 0
    for seed in range(10):
        for cv in (0.02, 0.05, 0.1):
            s, _ = iteration_series(500, changes=((120, 1.3), (260, 0.9), (380, 1.5)), cv=cv,
                                    seed=seed)
            q = default_prior(s)
            agree += changepoints(s, hazard=0.01, **q) == reference_changepoints(s, 0.01, **q)
            cases += 1
    return {"n": n, "reference_us_per_update": ref_mean * 1e6, "ours_us_per_update": ours_mean * 1e6,
            "speedup_mean": ref_mean / ours_mean, "reference_us_at_end": ref_at_end * 1e6,
            "ours_us_at_end": ours_at_end * 1e6, "speedup_at_end": ref_at_end / ours_at_end,
            "changepoints_agree": f"{agree}/{cases}"}


def bench_pipeline(period: int = 50, n_iter: int = 20_000) -> dict:
    cs = call_stream(period, n_iter=n_iter, noise=0.0, seed=3)
    cat = load_catalog()
    fn = np.full(len(cs.types), cat.by_name["ncclAllReduce"].fid, dtype=np.int64)
    out = {}
    for batch in (4096,):
        pipe = JobPipeline(cat)
        pipe.add_rank(1, 0)
        t = time.perf_counter()
        events = 0
        for i in range(0, len(cs.types), batch):
            events += len(pipe.feed_calls(1, fn[i:i + batch], cs.types[i:i + batch].astype(np.uint64),
                                          cs.start_ns[i:i + batch], cs.dur_ns[i:i + batch]))
        dt = time.perf_counter() - t
        out = {"period": period, "calls": len(cs.types), "batch": batch,
               "calls_per_s": len(cs.types) / dt, "events": events}
    return out


def bench_callcross() -> dict:
    """Records of 3 ranks' gloo all-reduces (tests/test_callcross.py's
    generator), fed as the tracer reads them: every half second."""
    from test_callcross import job
    from greyhound_bpf.diagnosis.callcross import CallCross
    cat = load_catalog()
    ranks = {100 + r: r for r in range(3)}
    out = {}
    for name, ms, calls, n in (("fast", 100, 30, 2000), ("sparse", 1500, 3, 600)):
        recs = job({0: ms, 1: ms, 2: 3 * ms}, n, calls=calls)     # in order of their ends
        ends = recs["start_ns"] + recs["dur_ns"]
        cuts = np.searchsorted(ends, np.arange(0, int(ends[-1]) + 10**9, 5 * 10**8), "right")
        batches = [recs[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
        cc = CallCross(cat)
        t = time.perf_counter()
        for batch in batches:
            cc.feed(batch, ranks)
        dt = time.perf_counter() - t
        out[name] = {"calls": len(recs), "calls_per_s": len(recs) / dt,
                     "core_share": dt / (int(ends[-1]) / 1e9), "looked": cc.last is not None}
    return out


def bench_start() -> dict:
    code = "import time; t=time.perf_counter(); from greyhound_bpf.engine import warm_up; warm_up(); print(time.perf_counter()-t)"
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        run = lambda: float(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,  # noqa: E731
                                           capture_output=True, text=True, check=True).stdout)
        cold = run()
        warm = statistics.median(run() for _ in range(3))
    fixture = ROOT / "tests/fixtures/gloo_ddp_2rank.jsonl"
    exe = Path(sys.executable).parent / "greyhound-trace"
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([str(exe), "replay", str(fixture)], capture_output=True, check=True)
        ts.append(time.perf_counter() - t)
    return {"cold_compile_s": cold, "warm_start_s": warm, "warm_replay_s": statistics.median(ts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    from greyhound_bpf.engine import warm_up
    warm_up()
    res = {"acf": bench_acf()}
    a = res["acf"]
    print(f"ACF n={a['n']} nlags={a['nlags']}: ours {a['ours_ms']:.2f} ms; statsmodels "
          f"(default, FFT) {a['statsmodels_fft_ms']:.2f} ms (ours x{a['speedup_vs_fft']:.1f} "
          f"faster), direct {a['statsmodels_ms']:.2f} ms (x{a['speedup']:.1f}); max |diff| "
          f"{a['max_abs_diff']:.1e}")
    res["bocd"] = b = bench_bocd()
    print(f"BOCD n={b['n']}: reference {b['reference_us_per_update']:.0f} us/update, ours "
          f"{b['ours_us_per_update']:.1f} us/update (x{b['speedup_mean']:.0f}); at t=10,000: "
          f"{b['reference_us_at_end']:.0f} vs {b['ours_us_at_end']:.1f} us "
          f"(x{b['speedup_at_end']:.0f}); change points agree {b['changepoints_agree']}")
    res["pipeline"] = p = bench_pipeline()
    print(f"pipeline (records -> iterations -> detector), period {p['period']}: "
          f"{p['calls_per_s'] / 1e6:.2f} M call records/s on one core ({p['calls']} calls)")
    res["callcross"] = c = bench_callcross()
    for k, v in c.items():
        print(f"call-by-call look, a {k} job: {v['calls_per_s'] / 1e6:.2f} M call records/s "
              f"on one core ({v['calls']} calls; x{p['calls_per_s'] / v['calls_per_s']:.2f} "
              f"the pipeline's time per record; {'looking' if v['looked'] else 'gate closed'}): "
              f"{100 * v['core_share']:.3f}% of one core over the job's time")
    res["start"] = s = bench_start()
    print(f"start: cold compile {s['cold_compile_s']:.1f} s, warm start {s['warm_start_s']:.2f} s; "
          f"warm `greyhound-trace replay` of the fixture {s['warm_replay_s']:.2f} s (goal < 2 s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
