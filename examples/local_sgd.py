#!/usr/bin/env python3
"""Post-local SGD over gloo on the CPU, with PyTorch's own parts: DDP with
the `post_localSGD_hook` communication hook and a `PostLocalSGDOptimizer`
around SGD with momentum, whose `PeriodicModelAverager` averages the
parameters every `--period` steps. For the first `--warmup` steps DDP
all-reduces the gradients at every step, as any DDP job; after them no
gradient is synchronised at all (`post_local_gradient_allreduce=False`):
each rank takes `--period` steps on its own, and the only collective is
the parameters' all-reduce after the last of them. The job's call
pattern changes mid-run, and its iteration, as the collectives see it,
becomes `--period` steps (at the defaults, about 15 s after the start:
often just after an attach). A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/local_sgd.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, `averaged`: whether the parameters were averaged after it, and
with --checksums `params`: a checksum of this rank's parameters) for the
tests and benchmarks.
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
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--warmup", type=int, default=1000,
                   help="steps with the gradients all-reduced, before local SGD")
    p.add_argument("--period", type=int, default=4, help="local steps per averaging")
    p.add_argument("--batch", type=int, default=64, help="samples per step")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = [nn.Linear(32, args.width), nn.ReLU()]
    for _ in range(args.layers - 1):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = DDP(nn.Sequential(*layers, nn.Linear(args.width, 1)))
    # subgroup=None would all-reduce within each machine after the warm-up;
    # without the post-local all-reduce there is no gradient sync at all.
    model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=None,
                                               start_localSGD_iter=args.warmup,
                                               post_local_gradient_allreduce=False),
                             post_localSGD_hook)
    averager = PeriodicModelAverager(period=args.period, warmup_steps=args.warmup)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                averager)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, 32, generator=gen)
            y = torch.tanh(x @ target)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            k = averager.step             # averaged after this step's update?
            opt.step()
            averaged = k >= args.warmup and (k - args.warmup) % args.period == 0
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(loss.item(), 6), "averaged": averaged}
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
