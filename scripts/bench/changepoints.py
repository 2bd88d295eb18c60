"""`greyhound_bpf.engine.changepoints(x)` with its defaults against a
textbook BOCPD, on real series annotated by people.

Series (tests/fixtures/tcpd): the well log, US business inventories, and the
Nile's volume at Aswan (from statsmodels), each with its five TCPD
annotators' change points. The textbook BOCPD is Adams & MacKay's: constant
hazard 1/100, a Normal-Gamma prior (mu0 0, kappa0 1, alpha0 1, beta0 1) on
the z-scored series, every run length kept (tests/bocd_reference.py),
segments read from the MAP run lengths as ours are.

Scored as TCPD scores it (van den Burg & Williams 2020), from the paper's
definitions: the first point always counts as a change point; F1 with a
margin of 5 (precision against the union of the annotations, recall the
mean over annotators, each annotated point matched at most once); and
segmentation covering, the mean over annotators of the length-weighted best
Jaccard overlap of each of their segments with a predicted one.

Nothing in changepoints() was tuned on these series: they are held out.

    scripts/bench_changepoints
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bocd_reference import covering, f1, reference_changepoints  # noqa: E402

from greyhound_bpf.engine import changepoints  # noqa: E402

DATA = ROOT / "tests" / "fixtures" / "tcpd"


def series() -> dict[str, np.ndarray]:
    out = {n: np.array((DATA / f"{n}.txt").read_text().split(), dtype=float)
           for n in ("well_log", "businv")}
    from statsmodels.datasets import nile
    out["nile"] = nile.load_pandas().data["volume"].to_numpy(dtype=float)
    return out


def textbook(x: np.ndarray) -> list[int]:
    z = (x - x.mean()) / (x.std() or 1.0)
    return reference_changepoints(z, 1 / 100, 0.0, 1.0, 1.0, 1.0)


def main() -> int:
    ann = json.loads((DATA / "annotations.json").read_text())
    rows = []
    print(f"{'series':10s} {'n':>5s}   {'F1 ours':>8s} {'textbook':>9s}   "
          f"{'cover ours':>10s} {'textbook':>9s}   change points ours / textbook")
    for name, x in series().items():
        ours, ref = changepoints(x), textbook(x)
        r = {"name": name, "f1": f1(ann[name], ours), "f1_ref": f1(ann[name], ref),
             "cover": covering(ann[name], ours, len(x)),
             "cover_ref": covering(ann[name], ref, len(x))}
        rows.append(r)
        print(f"{name:10s} {len(x):5d}   {r['f1']:8.3f} {r['f1_ref']:9.3f}   "
              f"{r['cover']:10.3f} {r['cover_ref']:9.3f}   {len(ours)} / {len(ref)}")
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("f1", "f1_ref", "cover",
                                                              "cover_ref")}
    print(f"{'mean':10s} {'':5s}   {mean['f1']:8.3f} {mean['f1_ref']:9.3f}   "
          f"{mean['cover']:10.3f} {mean['cover_ref']:9.3f}")
    for key, what in (("f1", "F1"), ("cover", "covering")):
        ok = mean[key] >= mean[f"{key}_ref"]
        print(f"{what}: changepoints() with its defaults "
              f"{'matches or beats' if ok else 'is BELOW'} the textbook BOCPD "
              f"({mean[key]:.3f} against {mean[f'{key}_ref']:.3f}; goal: at least match it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
