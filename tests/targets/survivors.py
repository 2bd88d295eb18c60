#!/usr/bin/env python3
"""A job that outlives a lost rank, as fault-tolerant trainers do (torchft,
elastic loops that catch the error): gloo all-reduces in a loop; when a
peer dies inside a collective, gloo throws, the survivors catch it, form a
new group of the ranks left (on --port2) and go on for --after steps.

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set. Prints `lost: ...` when the collective fails, `regrouped N at NS` and
`done` at the end; exit 0 then, 3 if the second group fails too."""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port2", type=int, required=True)
    ap.add_argument("--after", type=int, default=300)
    ap.add_argument("--lost-rank", type=int, required=True)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.ones(1 << 14)
    steps = 0
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1.0)
            steps += 1
            if steps % 100 == 0:
                print(f"step {steps}", flush=True)
            time.sleep(0.002)
    except RuntimeError as e:
        print(f"lost: {str(e).splitlines()[0][:160]}", flush=True)
    dist.destroy_process_group()
    left = [r for r in range(world) if r != args.lost_rank]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], args.port2, len(left),
                          is_master=rank == left[0], timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=left.index(rank), world_size=len(left))
    print(f"regrouped {len(left)} at {time.time_ns()}", flush=True)
    try:
        for _ in range(args.after):
            dist.all_reduce(t)
            time.sleep(0.002)
    except RuntimeError as e:
        print(f"lost again: {e}", flush=True)
        return 3
    dist.destroy_process_group()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
