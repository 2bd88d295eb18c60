#!/usr/bin/env python3
"""Data-parallel training whose input pipeline runs on rank 0 alone: each
step rank 0 draws the whole global batch, augments it (random crops and
flips of small images, noise, per-channel normalisation), and scatters one
shard to every rank (`dist.scatter`); every rank then runs a small CNN
under DDP on its shard, and the loss is all-reduced for the log every
`--log-every` steps. So rank 0 computes more than the others by design, and
they wait for it in the scatter every step (a single-reader dataset, a
preprocessing server on one rank): a job shape Greyhound's rules were not
written around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/scatter_batches.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss), with --checksums `params` (this rank's parameters: the
replicas agree).
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
from torch.nn.parallel import DistributedDataParallel as DDP

SIDE, CROP, CLASSES = 20, 16, 10


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random crops and flips, noise, and per-channel normalisation: the
    CPU work of an input pipeline, done for the whole global batch."""
    n = x.shape[0]
    oy = torch.randint(0, SIDE - CROP + 1, (n,), generator=gen)
    ox = torch.randint(0, SIDE - CROP + 1, (n,), generator=gen)
    rows = (oy[:, None] + torch.arange(CROP))[:, None, :, None].expand(n, 3, CROP, SIDE)
    x = x.gather(2, rows)
    cols = (ox[:, None] + torch.arange(CROP))[:, None, None, :].expand(n, 3, CROP, CROP)
    x = x.gather(3, cols)
    flip = torch.rand(n, generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    x = x + 0.1 * torch.randn(x.shape, generator=gen)
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True)
    return (x - mean) / (std + 1e-5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--log-every", type=int, default=10,
                   help="all-reduce the loss for the log every N steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    c = args.channels
    net = DDP(nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(2 * c * (CROP // 4) ** 2, CLASSES)))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # Rank 0's data: class-dependent colour patterns plus noise.
    gen = torch.Generator().manual_seed(args.seed)
    patterns = torch.randn(CLASSES, 3, SIDE, SIDE, generator=gen)
    x = torch.empty(args.batch, 3, CROP, CROP)
    y = torch.empty(args.batch, dtype=torch.int64)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    logged = None          # the loss last all-reduced for the log
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            xs = ys = None
            if rank == 0:
                labels = torch.randint(0, CLASSES, (world * args.batch,), generator=gen)
                images = patterns[labels] + torch.randn(len(labels), 3, SIDE, SIDE,
                                                        generator=gen)
                xs = list(augment(images, gen).chunk(world))
                ys = list(labels.chunk(world))
            dist.scatter(x, xs, src=0)
            dist.scatter(y, ys, src=0)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % args.log_every == args.log_every - 1:
                t = loss.detach().clone()
                dist.all_reduce(t)
                logged = round(t.item() / world, 6)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "logged_loss": logged}
                if args.checksums:
                    row["params"] = float(sum(q.detach().double().sum()
                                              for q in net.parameters()))
                log.write(json.dumps(row) + "\n")
            step += 1
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
