#!/usr/bin/env python3
"""One-step-stale data parallelism over gloo on the CPU (delayed gradient
averaging, as in PipeDream-2BW's and DeepSpeed's overlapped updates): each
step a rank computes its gradients, starts their all-reduce asynchronously
(`async_op=True`, one flat buffer) and, instead of waiting for it, waits
for the *previous* step's, whose averaged gradients it then applies. The
all-reduce of step t overlaps the forward and backward of step t + 1, so
the ranks meet once a step, a step late, inside `Work.wait()`: a job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/stale_allreduce.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, and `applied`: the step whose averaged gradients this step applied,
or null), with --checksums `params`: a checksum of the parameters after
the step (the ranks agree) and `grad`: the sum of this step's own local
gradients (before averaging).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * width, 10))


def batch(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose label is the brightest of ten fixed patterns in them."""
    y = torch.randint(0, 10, (size,), generator=gen)
    x = 0.5 * torch.randn(size, 3, 16, 16, generator=gen)
    x[torch.arange(size), y % 3, y, :] += 1.5
    return x, y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of the parameters and the local gradients")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(args.width, args.seed)
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    # Two flat buffers in turn: one in flight while the next step fills the other.
    bufs = [torch.zeros(sum(q.numel() for q in params)) for _ in range(2)]
    pending = None                  # (step, work, buffer) of the all-reduce in flight
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x, y = batch(gen, args.batch)
            loss = F.cross_entropy(net(x), y)
            net.zero_grad(set_to_none=True)
            loss.backward()
            mine = bufs[step % 2]
            torch.cat([q.grad.reshape(-1) for q in params], out=mine)
            local = float(mine.sum()) if args.checksums else None
            work = dist.all_reduce(mine, async_op=True)
            applied = None
            if pending is not None:
                applied, prev, buf = pending
                prev.wait()
                with torch.no_grad():
                    at = 0
                    for q in params:
                        q -= args.lr / world * buf[at:at + q.numel()].view_as(q)
                        at += q.numel()
            pending = (step, work, mine)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "applied": applied}
                if args.checksums:
                    row["params"] = float(sum(q.detach().double().sum() for q in params))
                    row["grad"] = local
                log.write(json.dumps(row) + "\n")
            step += 1
        if pending is not None:
            pending[1].wait()       # the last all-reduce, before the group goes
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
