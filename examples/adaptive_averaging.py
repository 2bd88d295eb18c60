#!/usr/bin/env python3
"""Local SGD with drift-triggered model averaging over gloo on the CPU (as
in adaptive communication schemes such as AdaComm, or federated training
that syncs on divergence): each rank steps its own replica on its own data
and, every step, all-reduces one number, how far its parameters have moved
from the last average (the squared distance). When the ranks' mean drift
passes `--threshold`, or `--max-period` steps have passed, they average
their parameters in one flat all-reduce. The averaging interval depends on
the data and the learning rate, so the job's steps are of two kinds at an
irregular rhythm: a short all-reduce of one float, or that and the whole
model's. A job shape Greyhound's rules were not written around (its corpus
records it as held out):

    torchrun --nproc-per-node 3 examples/adaptive_averaging.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, `drift`: this rank's squared distance from the last average before
the decision, `averaged`: whether the parameters were averaged at this
step), with --checksums `local`: a checksum of the rank's parameters
before any averaging, and `params`: after it.
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
    return nn.Sequential(nn.Linear(48, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 8))


def batch(gen: torch.Generator, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own data: one linear rule, each rank's inputs shifted its
    own way (the replicas drift apart at their own pace between averages),
    a quarter of the labels noise (the gradients never vanish)."""
    x = torch.randn(size, 48, generator=gen) + 0.3 * (rank + 1)
    w = torch.linspace(-1, 1, 48 * 8).reshape(48, 8)
    y = (x @ w).argmax(dim=1)
    noisy = torch.rand(size, generator=gen) < 0.25
    return x, torch.where(noisy, torch.randint(0, 8, (size,), generator=gen), y)


def should_average(mean_drift: float, since: int, threshold: float, max_period: int) -> bool:
    return mean_drift > threshold or since >= max_period


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threshold", type=float, default=0.006,
                   help="mean squared drift from the last average that triggers the next")
    p.add_argument("--max-period", type=int, default=16,
                   help="steps after which the replicas are averaged anyway")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of the parameters before and after averaging")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(args.width, args.seed)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    flat = torch.empty(sum(q.numel() for q in params))
    anchor = torch.cat([q.detach().reshape(-1) for q in params])
    since = 0
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x, y = batch(gen, args.batch, rank)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            since += 1
            with torch.no_grad():
                torch.cat([q.reshape(-1) for q in params], out=flat)
                drift = torch.tensor([float((flat - anchor).square().sum())])
                mine = float(drift)
                local = float(flat.double().sum()) if args.checksums else None
                dist.all_reduce(drift)
                averaged = should_average(float(drift) / world, since, args.threshold,
                                          args.max_period)
                if averaged:
                    dist.all_reduce(flat)
                    flat /= world
                    at = 0
                    for q in params:
                        q.copy_(flat[at:at + q.numel()].view_as(q))
                        at += q.numel()
                    anchor.copy_(flat)
                    since = 0
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "drift": mine, "averaged": averaged}
                if args.checksums:
                    row["local"] = local
                    row["params"] = float(sum(q.detach().double().sum() for q in params))
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
