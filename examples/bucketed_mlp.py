#!/usr/bin/env python3
"""A wide MLP under DDP over gloo on the CPU whose gradients go in many small
buckets, each all-reduced as soon as backward has filled it, so the
collectives overlap the rest of backward; after each step the ranks
all-reduce their loss for the log (a tiny collective every iteration), and
every `--sync-every` iterations they meet at a barrier and all-gather a
metrics vector (a logging step). So an iteration holds several collectives
of different sizes with compute between them, and a periodic extra phase.
A job shape Greyhound's rules were not written around (its corpus records
it as held out):

    torchrun --nproc-per-node 3 examples/bucketed_mlp.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss: the mean over ranks, `buckets`: the gradient all-reduces of
that iteration, and `synced` on the logging steps) for the tests and
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(width: int, layers: int, inputs: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(inputs, width), nn.GELU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=96, help="samples per rank per iteration")
    p.add_argument("--width", type=int, default=384, help="the hidden layers' width")
    p.add_argument("--layers", type=int, default=6, help="hidden layers")
    p.add_argument("--bucket-mb", type=float, default=0.5,
                   help="DDP's bucket size: smaller, more all-reduces per iteration")
    p.add_argument("--sync-every", type=int, default=25,
                   help="iterations between logging steps (a barrier and an all-gather)")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    inputs = 128
    model = DDP(mlp(args.width, args.layers, inputs), bucket_cap_mb=args.bucket_mb)
    buckets = {"n": 0}

    def counted(state, bucket):                 # DDP's own all-reduce, counted
        state["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(buckets, counted)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.randn(inputs, 1, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, inputs, generator=gen)
            y = torch.tanh(x @ target)
            opt.zero_grad(set_to_none=True)
            before = buckets["n"]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)                  # the loss the log shows: every rank's
            synced = (step + 1) % args.sync_every == 0
            if synced:
                dist.barrier()
                got = [torch.zeros(3) for _ in range(world)]
                dist.all_gather(got, torch.tensor([float(rank), loss.item(), float(step)]))
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(mean.item() / world, 5), "buckets": buckets["n"] - before}
            if synced:
                rec["synced"] = True
            if log:
                log.write(json.dumps(rec) + "\n")
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
