"""Replay the scenario corpus (tests/scenarios) through JobAnalysis and score
it against the truth: detection delay, false alarms, diagnosis right /
wrong / unknown, plans and their predicted gain, validations and pauses.
The tune split and the held-out split (no rule tuned on it) are reported
apart. This is how a change to a rule is judged: replay, compare, and look
at the held-out line before believing it.

    scripts/bench_scenarios                     # the table
    scripts/bench_scenarios --json out.json     # every row, for a comparison
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import corpus  # noqa: E402


def _s(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def fault_line(f: dict) -> str:
    what = f"{f['kind']} r{f['rank']}" + (" (pre)" if f["before_attach"] else "")
    return (f"{what:15s} slow {_s(f['slowdown_s']):>5} passive {_s(f['passive_s']):>5} "
            f"valid {_s(f['validated_s']):>5}")


def totals(rows: list[dict]) -> dict:
    faults = [f for r in rows for f in r["faults"]]

    def med(key):
        v = [f[key] for f in faults if f[key] is not None]
        return statistics.median(v) if v else None
    return {
        "scenarios": len(rows), "faults": len(faults),
        "passive_named": sum(f["passive_s"] is not None for f in faults),
        "validated_named": sum(f["validated_s"] is not None for f in faults),
        "detected": sum(f["slowdown_s"] is not None or f["passive_s"] is not None
                        for f in faults),
        "passive_median_s": med("passive_s"), "validated_median_s": med("validated_s"),
        "wrong": sum(r["wrong"] for r in rows), "right": sum(r["right"] for r in rows),
        "false_slowdowns": sum(r["false_slowdowns"] for r in rows),
        "unconfirmed_slowdowns": sum(r["unconfirmed_slowdowns"] for r in rows),
        "plans_outside": sum(r["plans_outside"] for r in rows),
        "plans_in_fault": sum(r["plans_in_fault"] for r in rows),
        "validations": sum(r["validations"] for r in rows),
        "paused_s": round(sum(r["paused_s"] for r in rows), 1),
        "seconds": round(sum(r["seconds"] for r in rows), 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="scenarios (default: all)")
    p.add_argument("--json", metavar="FILE", help="also write every row here")
    args = p.parse_args(argv)
    names = args.names or corpus.names()
    if not names:
        print("bench_scenarios: no recorded scenarios in tests/scenarios", file=sys.stderr)
        return 1
    rows = []
    head = "fault: delay (s) to a slowdown / passive / validated verdict"
    print(f"{'scenario':28s} {'split':7s} {head:58s} right wrong unk  alarms plans val pause")
    for n in names:
        t0 = time.perf_counter()
        r = corpus.score(corpus.truth(n), corpus.replay(n))
        r["replay_s"] = round(time.perf_counter() - t0, 2)
        rows.append(r)
        fl = "; ".join(fault_line(f) for f in r["faults"]) or "(healthy)"
        print(f"{n:28s} {r['split']:7s} {fl:58s} {r['right']:5d} {r['wrong']:5d} "
              f"{r['unknown']:4d} {r['false_slowdowns']:3d}/{r['unconfirmed_slowdowns']:<3d}"
              f"{r['plans_outside']:2d}/{r['plans_in_fault']:<3d}{r['validations']:3d} "
              f"{r['paused_s']:5.1f}", flush=True)
        for w in r["wrong_verdicts"]:
            print(f"{'':36s}WRONG {w['evidence']} {w['cause']} {w['ranks']} {w.get('link')}: "
                  f"{w['reason'][:90]}")
    print("\n(alarms: job slowdowns outside every fault / of them unconfirmed by the job's own "
          "log; plans: outside faults / in a fault)\n")
    out = {}
    for split in ("tune", "heldout"):
        part = [r for r in rows if r["split"] == split]
        if not part:
            continue
        t = out[split] = totals(part)
        print(f"{split:8s} {t['scenarios']} scenarios, {t['seconds']:.0f} s attached, "
              f"{t['faults']} faults: named passively {t['passive_named']}/{t['faults']} "
              f"(median {_s(t['passive_median_s'])} s), validated {t['validated_named']}/"
              f"{t['faults']} (median {_s(t['validated_median_s'])} s); wrong verdicts "
              f"{t['wrong']}; false job slowdowns {t['false_slowdowns']} "
              f"({t['unconfirmed_slowdowns']} unconfirmed); plans outside faults "
              f"{t['plans_outside']}; {t['validations']} validations, paused "
              f"{t['paused_s']:.1f} s ({100 * t['paused_s'] / max(t['seconds'], 1):.2f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "totals": out}, indent=1,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
