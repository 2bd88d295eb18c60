#!/usr/bin/env python3
"""Decentralized SGD (D-PSGD, Lian et al. 2017): no all-reduce of the
gradients and no parameter server. Each rank takes an SGD step on its own
data, then averages its parameters with its two neighbours on a ring: one
flat buffer sent to each (`isend`) and received from each (`irecv`), the
mean of the three kept. Every `--log-every` steps the ranks' losses are
all-reduced for the log (the job's only collective). A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/gossip_sgd.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
with its loss, and with --checksums `params`: a checksum of this rank's
parameters (the replicas differ, and their mean is what the gossip keeps).
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
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def gossip(model: nn.Module, rank: int, world: int) -> None:
    """x <- (x + x_left + x_right) / 3 over the ring (one neighbour with 2
    ranks)."""
    flat = parameters_to_vector(model.parameters()).detach()
    peers = sorted({(rank - 1) % world, (rank + 1) % world} - {rank})
    bufs = [torch.empty_like(flat) for _ in peers]
    works = [dist.isend(flat, p) for p in peers] + [dist.irecv(b, p) for b, p in zip(bufs, peers)]
    for w in works:
        w.wait()
    vector_to_parameters((flat + sum(bufs)) / (1 + len(peers)), model.parameters())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--width", type=int, default=1024, help="hidden units")
    p.add_argument("--log-every", type=int, default=50, help="steps between loss all-reduces")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)             # every rank starts from one model
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # Each rank's data leans towards its own classes (non-IID, as devices'
    # data does), so the gossip is what makes one model of them.
    centers = torch.randn(10, 64, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    bias = torch.full((10,), 1.0)
    bias[[(rank * 3 + k) % 10 for k in range(3)]] = 4.0
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step, mean_loss = 0, None
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            y = torch.multinomial(bias, args.batch, replacement=True, generator=gen)
            x = centers[y] + 3.0 * torch.randn(args.batch, 64, generator=gen)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                gossip(model, rank, world)
            if step % args.log_every == args.log_every - 1:
                t = torch.tensor([loss.item()])
                dist.all_reduce(t)                      # the ranks' mean loss, for the log
                mean_loss = round(t.item() / world, 6)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "mean_loss": mean_loss}
                if args.checksums:
                    row["params"] = float(parameters_to_vector(model.parameters())
                                          .detach().double().sum())
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
