#!/usr/bin/env python3
"""DDP with `static_graph=True` and activation checkpointing, over gloo on
the CPU: a stack of residual MLP blocks, each recomputed in backward
(`torch.utils.checkpoint`, reentrant, the combination DDP's static graph
exists for), gradients clipped by norm, and every `--metrics-every` steps
the ranks' metrics (loss, samples per second) gathered as Python objects
with `all_gather_object`, which gloo carries as two all-gathers (the
pickled sizes, then the padded bytes) for rank 0 to print. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/static_graph.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, `gathered`: the ranks whose metrics this rank received after the step,
empty on the other steps, and with --checksums `params`: a checksum of this
rank's parameters) for the tests and benchmarks.
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
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Net(nn.Module):
    """Residual blocks, each one's activations recomputed in backward."""

    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=True)
        return self.out(h)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=128, help="samples per step and rank")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--metrics-every", type=int, default=20,
                   help="gather every rank's metrics for rank 0 every this many steps")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    features, classes = 64, 10
    model = DDP(Net(features, args.width, args.depth, classes), static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, features, generator=gen)
            y = torch.randint(0, classes, (args.batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            gathered = []
            if (step + 1) % args.metrics_every == 0:
                mine = {"rank": rank, "loss": loss.item(),
                        "samples_per_s": args.batch * 1e9 / max(1, time.time_ns() - t0)}
                every = [None] * world
                dist.all_gather_object(every, mine)
                gathered = sorted(m["rank"] for m in every)
                if rank == 0:
                    mean = sum(m["loss"] for m in every) / world
                    rate = sum(m["samples_per_s"] for m in every)
                    print(f"step {step + 1}: loss {mean:.4f}, {rate:.0f} samples/s",
                          flush=True)
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(loss.item(), 6), "gathered": gathered}
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
