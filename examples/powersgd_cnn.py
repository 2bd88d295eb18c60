#!/usr/bin/env python3
"""A small CNN under DDP over gloo on the CPU whose gradients go through
PyTorch's PowerSGD communication hook (Vogels et al., NeurIPS 2019): after
`--start-iter` iterations of plain all-reduce, every bucket's gradients are
compressed to low-rank factors P and Q, each all-reduced in turn, with
orthogonalisation and error feedback computed in between, inside the
communication phase. So the job changes its call pattern while it runs,
and each rank computes in the middle of its collectives. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/powersgd_cnn.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss, and `hook_iter`: the iterations the hook has seen; it
compresses from --start-iter on) for the tests and benchmarks.
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
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP


def cnn(width: int) -> nn.Module:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.MaxPool2d(2))
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.Flatten(), nn.Linear(4 * width * 16, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=32, help="32x32 images per rank per iteration")
    p.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    p.add_argument("--rank-approx", type=int, default=2,
                   help="PowerSGD's matrix approximation rank")
    p.add_argument("--start-iter", type=int, default=300,
                   help="iterations of plain all-reduce before PowerSGD starts")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    # One bucket: gloo runs collectives in the order each rank issues them,
    # and the hook's callbacks of several buckets can issue theirs in a
    # different order on different ranks.
    model = DDP(cnn(args.width), bucket_cap_mb=100)
    state = powerSGD.PowerSGDState(process_group=None,
                                   matrix_approximation_rank=args.rank_approx,
                                   start_powerSGD_iter=args.start_iter)
    model.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, 3, 32, 32, generator=gen)
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0,
                                      "loss": round(loss.item(), 4),
                                      "hook_iter": state.iter}) + "\n")
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
