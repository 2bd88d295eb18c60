#!/usr/bin/env python3
"""A batch-size ramp-up, as large-model pretraining runs one (Megatron's
`--rampup-batch-size`): DDP over gloo on the CPU, gradient accumulation
with `no_sync()` on all but the last micro-batch, and the number of
micro-batches per iteration growing from `--start-mb` by one every
`--ramp-every` iterations up to `--mb`. The collectives are the same at
every iteration; the compute between them grows by design, every rank
alike, so a healthy job gets slower step by step for its first minute.
A job shape Greyhound's rules were not written around (its corpus records
it as held out):

    torchrun --nproc-per-node 3 examples/batch_rampup.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss, `microbatches`, and with --checksums `params`: a checksum
of this rank's parameters) for the tests and benchmarks.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def microbatches(step: int, start: int, full: int, every: int) -> int:
    """The ramp: `start` micro-batches, one more every `every` iterations."""
    return min(full, start + step // every)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--start-mb", type=int, default=2, help="micro-batches at the start")
    p.add_argument("--mb", type=int, default=8, help="micro-batches once ramped up")
    p.add_argument("--ramp-every", type=int, default=300,
                   help="iterations between two steps of the ramp")
    p.add_argument("--batch", type=int, default=64, help="samples per micro-batch")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.GELU(),
                              nn.Linear(args.width, args.width), nn.GELU(),
                              nn.Linear(args.width, args.width), nn.GELU(),
                              nn.Linear(args.width, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.randn(64, 1, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            n = microbatches(step, args.start_mb, args.mb, args.ramp_every)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m in range(n):
                x = torch.randn(args.batch, 64, generator=gen)
                with contextlib.nullcontext() if m == n - 1 else model.no_sync():
                    loss = F.mse_loss(model(x), torch.tanh(x @ target)) / n
                    loss.backward()
                total += loss.item()
            opt.step()
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(total, 6), "microbatches": n}
            if log and args.checksums:
                with torch.no_grad():
                    rec["params"] = round(sum(float(q.double().sum())
                                              for q in model.parameters()), 9)
            if log:
                log.write(json.dumps(rec) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave with the model alive, as examples/moe_alltoall.py does: freeing
    # DDP's reducer at exit can deadlock gloo's threads (pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
