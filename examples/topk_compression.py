#!/usr/bin/env python3
"""Top-k gradient sparsification with error feedback (as Deep Gradient
Compression, Lin et al., 2018) over gloo on the CPU: no DDP. After each
backward every rank adds its residual (what it did not send before) to its
flat gradient, keeps the k largest entries, and all-gathers their values
and their indices (two all-gathers of k each, a sparse all-reduce); every
rank then sums every rank's entries into the same dense update, and keeps
the rest as its new residual. So a step is compute, a top-k selection, and
two all-gathers: a job shape Greyhound's rules were not written around
(its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/topk_compression.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss), with --checksums `params` (this rank's parameters).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per step (every rank's)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--density", type=float, default=0.01,
                   help="share of the gradient's entries each rank sends")
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
    # A classifier of 20 Gaussian clusters in 64 dimensions.
    net = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                        nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, 20))
    centres = torch.randn(20, 64, generator=torch.Generator().manual_seed(args.seed)) * 2
    params = list(net.parameters())
    n = sum(q.numel() for q in params)
    k = max(1, int(args.density * n))
    residual = torch.zeros(n)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            y = torch.randint(0, 20, (args.batch,), generator=gen)
            x = centres[y] + torch.randn(args.batch, 64, generator=gen)
            loss = F.cross_entropy(net(x), y)
            net.zero_grad(set_to_none=True)
            loss.backward()
            g = parameters_to_vector(q.grad for q in params) + residual
            idx = g.abs().topk(k).indices
            vals = g[idx]
            residual = g.index_fill(0, idx, 0.0)           # error feedback: kept for later
            all_vals = [torch.empty_like(vals) for _ in range(world)]
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            dist.all_gather(all_vals, vals)
            dist.all_gather(all_idx, idx)
            update = torch.zeros(n).index_add_(0, torch.cat(all_idx), torch.cat(all_vals))
            with torch.no_grad():
                vector_to_parameters(parameters_to_vector(params) - args.lr * update / world,
                                     params)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                if args.checksums:
                    row["params"] = float(parameters_to_vector(params).detach().double().sum())
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
