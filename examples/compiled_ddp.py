#!/usr/bin/env python3
"""A residual MLP under DDP compiled with `torch.compile` (Inductor, its
C++ kernels on the CPU), as PyTorch's DDP tutorial recommends: the
DDP-wrapped model is compiled, and Dynamo's DDPOptimizer splits the graph
at the gradient buckets' edges, so each bucket's all-reduce starts from
between compiled pieces of the backward. The first steps compile (seconds
on a warm Inductor cache, a minute on a cold one, with `g++` children of
every rank); after that the ranks run fused kernels. The CPU over gloo. A
job shape Greyhound's rules were not written around (its corpus records
it as held out):

    torchrun --nproc-per-node 3 examples/compiled_ddp.py
    sudo greyhound-trace attach <torchrun's PID>

The data are each rank's own draws of a fixed random teacher's inputs and
outputs. --truth FILE logs each step (JSON lines: rank, index, start_ns,
dur_ns, loss, and with --checksums `params`, a checksum of this rank's
model, and `graphs`, the graphs Dynamo compiled) for the tests and
benchmarks.
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
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def net(dim: int, depth: int) -> nn.Module:
    return nn.Sequential(*[Block(dim) for _ in range(depth)], nn.LayerNorm(dim),
                         nn.Linear(dim, dim))


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return round(sum(float(p.double().sum()) for p in model.parameters()), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="samples per step and rank")
    p.add_argument("--dim", type=int, default=128, help="the model's width")
    p.add_argument("--depth", type=int, default=4, help="residual blocks")
    p.add_argument("--bucket-mb", type=float, default=1.0,
                   help="DDP's gradient bucket size (MiB): the compiled graph's pieces")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's model with each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(net(args.dim, args.depth), bucket_cap_mb=args.bucket_mb)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher = torch.randn(args.dim, args.dim, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, args.dim, generator=gen)
            y = torch.tanh(x @ teacher)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(compiled(x), y)
            loss.backward()
            opt.step()
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                if args.checksums:
                    rec["params"] = checksum(model)
                    rec["graphs"] = counters["stats"]["unique_graphs"]
                log.write(json.dumps(rec) + "\n")
            if rank == 0 and (step + 1) % 500 == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
