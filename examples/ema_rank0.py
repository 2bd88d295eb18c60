#!/usr/bin/env python3
"""A small CNN under DDP whose rank 0 alone keeps an exponential moving
average (EMA) of the weights, updated after every optimizer step, as
YOLOv5's and many detection codebases' training loops do (`ModelEMA` on
the main process only, its decay ramped up over the first updates). So
rank 0 does a little more work in every iteration than the others, by
design, and they wait for it in the next all-reduce: a rank that is
always a bit slower and is not a fault. The CPU over gloo. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/ema_rank0.py
    sudo greyhound-trace attach <torchrun's PID>

The images are each rank's own draws of two textures to tell apart.
--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, and with --checksums `params` (a checksum of this rank's model) and,
on rank 0, `ema` (of its EMA)) for the tests and benchmarks.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def net(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.SiLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.SiLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * width * 4 * 4, 256), nn.SiLU(),
        nn.Linear(256, 2))


class ModelEMA:
    """The weights' moving average, its decay ramped up over the first
    updates (so the early average follows the model closely)."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0):
        self.ema = copy.deepcopy(model).eval()
        self.decay, self.tau, self.updates = decay, tau, 0
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        for e, m in zip(self.ema.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(d).add_(m.detach(), alpha=1 - d)


def images(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Stripes (label 0) or checks (label 1) at random phases, with noise."""
    y = torch.randint(2, (n,), generator=gen)
    ii, jj = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    phase = torch.rand(n, 1, 1, generator=gen) * 6.28
    stripes = torch.sin(ii * 1.2 + phase)
    checks = torch.sin(ii * 1.2 + phase) * torch.sin(jj * 1.2 + phase)
    x = torch.where(y[:, None, None] == 0, stripes, checks)
    return (x + 0.5 * torch.randn(n, 16, 16, generator=gen)).unsqueeze(1), y


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return round(sum(float(p.double().sum()) for p in model.parameters()), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=32, help="images per step and rank")
    p.add_argument("--width", type=int, default=16, help="the first convolution's channels")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of the model (and rank 0's EMA) with each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(net(args.width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    ema = ModelEMA(model.module) if rank == 0 else None
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x, y = images(args.batch, gen)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if ema:
                ema.update(model.module)
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                if args.checksums:
                    rec["params"] = checksum(model)
                    if ema:
                        rec["ema"] = checksum(ema.ema)
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
