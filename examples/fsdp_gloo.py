#!/usr/bin/env python3
"""FSDP2 (`fully_shard`) over gloo on the CPU: an MLP of four blocks, each
sharded on its own, so that every iteration all-gathers each block's
parameters forward and backward and reduce-scatters its gradients. A job
shape Greyhound's rules were not written around (its corpus records it as
held out), and a plain example of attaching to a sharded job:

    torchrun --nproc-per-node 3 examples/fsdp_gloo.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
for the tests and benchmarks.
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
from torch.distributed.fsdp import fully_shard


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=256, help="the blocks' input and output width")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    w = args.width
    blocks = [nn.Sequential(nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w))
              for _ in range(4)]
    model = nn.Sequential(*blocks)
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, w, generator=gen)
            loss = (model(x) - x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0}) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)     # no process-group teardown: FSDP's can abort at exit on gloo
