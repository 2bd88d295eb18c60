#!/usr/bin/env python3
"""Megatron-style `num_microbatches` per data-parallel rank, from Greyhound.

Megatron-LM runs a step as `forward_backward_func(forward_step_func=...,
data_iterator=..., model=..., num_microbatches=N, ...)`, with N from its
micro-batch calculator: the same N on every data-parallel rank. Under a
Greyhound rebalance plan N is per rank: pass `gh.step().microbatches` as
`num_microbatches`, and scale each micro-batch's loss by `loss_scale`
instead of 1/N (Megatron divides by num_microbatches in its loss function),
so that the data-parallel all-reduce still averages the global batch.

This file runs without Megatron (CPU, gloo): `forward_backward_no_pipelining`
below has the shape of megatron.core.pipeline_parallel's function of that
name (a stand-in for it, named as such), so the calls are the ones a
Megatron trainer makes.

    torchrun --nproc-per-node 2 examples/megatron_style.py --control-file /tmp/ctl.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mitigation.distributed import Greyhound  # noqa: E402


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model,
                                   num_microbatches: int, loss_scale: float) -> list[float]:
    """Stand-in for megatron.core.pipeline_parallel.schedules'
    forward_backward_no_pipelining: gradients accumulate over
    `num_microbatches`, synchronised on the last one only."""
    losses = []
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = forward_step_func(data_iterator, model)
            (loss * loss_scale).backward()
        losses.append(loss.item())
    return losses


def forward_step(data_iterator, model):
    x = next(data_iterator)
    return nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))


def batches(gen):
    while True:
        yield torch.randn(16, 32, generator=gen)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control-file", help="Greyhound's control file (default: "
                   "$GREYHOUND_CONTROL_FILE; none: the even split)")
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--global-batch", type=int, default=128, help="samples per iteration")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch")
    p.add_argument("--step-log", help="append one JSON line per step per rank here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dp_world = dist.get_world_size()
    # Megatron's calculator: global batch / (micro batch x data-parallel size).
    if args.global_batch % (args.micro_batch * dp_world):
        p.error("--global-batch must be a multiple of --micro-batch x the rank count")
    total = args.global_batch // args.micro_batch
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = batches(torch.Generator().manual_seed(dist.get_rank()))
    log = open(args.step_log, "a", buffering=1) if args.step_log else None

    gh = Greyhound(args.control_file, microbatches=total // dp_world,
                   total_microbatches=total)
    step = 0
    while args.steps == 0 or step < args.steps:
        s = gh.step()
        opt.zero_grad(set_to_none=True)
        forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=data,
                                       model=model, num_microbatches=s.microbatches,
                                       loss_scale=s.loss_scale)
        opt.step()
        if log:
            log.write(json.dumps({"rank": dist.get_rank(), "step": step,
                                  "microbatches": s.microbatches,
                                  "seq": gh.applied_seq,
                                  "params": sum(float(t.sum()) for t in model.parameters())})
                      + "\n")
        step += 1
    del model, opt               # before the process group: see plain_pytorch.py
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
