#!/usr/bin/env python3
"""Record the gloo DDP trace kept as a test fixture (tests/fixtures/).

A 2-rank DDP job (scripts/demo_train.py) under torchrun, traced by
`greyhound-trace attach -o FILE --calls`. After --slow-after iterations,
rank 1 gets half a CPU through a cgroup CPU quota (greyhound_bpf.inject);
the job runs --steps iterations in all. The trainer's own per-iteration log
is saved beside the trace as the ground truth (OUT.truth.jsonl), and the
moment of the injection as OUT.inject.json.

    sudo .venv/bin/python scripts/record_fixture.py --out tests/fixtures/gloo_ddp_2rank
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from greyhound_bpf.probe.discovery import all_stats, descendants  # noqa: E402
from greyhound_bpf.inject import CpuQuota  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path prefix: OUT.jsonl and OUT.truth.jsonl")
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--slow-after", type=int, default=70)
    ap.add_argument("--quota", type=float, default=0.5, help="CPUs left to rank 1")
    ap.add_argument("--bucket-mb", default="0.25", help="DDP bucket size (all-reduces per step)")
    args = ap.parse_args()
    out = Path(args.out)
    trace, truth, go = Path(f"{out}.jsonl"), Path(f"{out}.truth.jsonl"), Path(f"{out}.go")
    for f in (trace, truth, go):
        f.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_ = Path(sys.executable).parent
    job = subprocess.Popen([str(bin_ / "torchrun"), "--nproc-per-node", "2", "--master-port",
                            str(port), str(ROOT / "scripts/demo_train.py"), "--steps",
                            str(args.steps), "--truth", str(truth), "--go-file", str(go),
                            "--bucket-mb", args.bucket_mb],
                           env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tracer = subprocess.Popen([str(bin_ / "greyhound-trace"), "attach", str(job.pid), "--calls",
                               "-o", str(trace), "-q"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        rank1 = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            attached = [r for line in trace.read_text().splitlines() if '"attach"' in line
                        for r in json.loads(line)["ranks"]] if trace.exists() else []
            if len(attached) >= 2:
                rank1 = next(r["pid"] for r in attached if r["rank"] == 1)
                break
            time.sleep(0.2)
        if rank1 is None:
            print("record_fixture: ranks were not attached in time", file=sys.stderr)
            return 1
        go.touch()
        while not truth.exists() or sum(1 for _ in truth.open()) < 2 * args.slow_after:
            time.sleep(0.05)
        with CpuQuota(rank1, args.quota):
            Path(f"{out}.inject.json").write_text(json.dumps(
                {"rank": 1, "pid": rank1, "quota": args.quota, "at_ns": time.time_ns()}) + "\n")
            print(f"record_fixture: rank 1 (pid {rank1}) limited to {args.quota} CPU",
                  file=sys.stderr)
            job.wait(timeout=600)
        tracer.wait(timeout=60)
    finally:
        for p in (job, tracer):
            if p.poll() is None:
                p.kill()
        for pid in descendants([job.pid], all_stats()):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        go.unlink(missing_ok=True)
    n = sum(1 for line in trace.open() if '"call"' in line)
    print(f"record_fixture: {n} calls in {trace}, ground truth in {truth}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
