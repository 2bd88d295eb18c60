#!/usr/bin/env python3
"""Tensor and data parallelism at once (Megatron-LM's 2-D layout) over
gloo on the CPU: the ranks form a grid of `--tp` tensor-parallel ranks by
world / tp data-parallel replicas. Each MLP block is split Megatron's way
across its tensor-parallel group: a column-parallel layer (each rank holds
a slice of the hidden units), then a row-parallel one whose partial outputs
are summed by an all-reduce in that group, in forward; backward all-reduces
the input's gradient there. DDP averages the gradients over the
data-parallel group only (ranks holding the same slices), after the last of
`--microbatches` backward passes (`no_sync` on the others). So every rank
is in two communicators, and a slow rank holds up its tensor-parallel
partner at every block and its data-parallel replica at every step. A job
shape Greyhound's rules were not written around (its corpus records it as
held out):

    torchrun --nproc-per-node 4 examples/tensor_data_parallel.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss, tp_rank, dp_rank, and with --checksums `params`: a checksum of
this rank's parameters) for the tests and benchmarks.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class _CopyToGroup(torch.autograd.Function):
    """Megatron's `f`: the identity forward; backward sums the input's
    gradient over the tensor-parallel group (each rank's slice of the
    hidden units contributed part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's `g`: forward sums the partial outputs over the group;
    the identity backward (the output, and so the loss, is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelMLP(nn.Module):
    """One block: LayerNorm, column-parallel dim -> hidden / tp, GELU,
    row-parallel hidden / tp -> dim, the sum over the group, a residual."""

    def __init__(self, dim: int, hidden: int, tp: int, group):
        super().__init__()
        self.group = group
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden // tp)
        self.down = nn.Linear(hidden // tp, dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(dim))     # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToGroup.apply(self.norm(x), self.group)
        part = self.down(F.gelu(self.up(h)))
        return x + _ReduceFromGroup.apply(part, self.group) + self.bias


def grid(world: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tensor-parallel groups (consecutive ranks, as Megatron places
    them on one node's GPUs) and the data-parallel ones (every tp-th)."""
    tps = [list(range(s, s + tp)) for s in range(0, world, tp)]
    dps = [list(range(k, world, tp)) for k in range(tp)]
    return tps, dps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per replica")
    p.add_argument("--microbatches", type=int, default=2, help="backward passes per step")
    p.add_argument("--batch", type=int, default=64, help="samples per micro-batch")
    p.add_argument("--dim", type=int, default=128, help="the model's width")
    p.add_argument("--hidden", type=int, default=512, help="each block's hidden width (all ranks)")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp or args.hidden % args.tp:
        sys.exit(f"tensor_data_parallel: --tp {args.tp} must divide the world ({world}) "
                 f"and --hidden ({args.hidden})")
    tp_rank, dp_rank = rank % args.tp, rank // args.tp
    tp_group = dp_group = None
    tps, dps = grid(world, args.tp)
    for ranks in tps:                # every rank creates every group, in one order
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for ranks in dps:
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    # The replicated parts start alike everywhere; each tensor-parallel
    # rank's slices alike across its data-parallel replicas.
    torch.manual_seed(args.seed)
    inp, head = nn.Linear(32, args.dim), nn.Linear(args.dim, 1)
    torch.manual_seed(args.seed * 1_000_003 + tp_rank + 1)
    blocks = [ParallelMLP(args.dim, args.hidden, args.tp, tp_group) for _ in range(args.blocks)]
    model = DDP(nn.Sequential(inp, *blocks, head), process_group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(args.seed))
    # A tensor-parallel group sees the same samples; replicas, their own.
    gen = torch.Generator().manual_seed(args.seed * 7_919 + dp_rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m in range(args.microbatches):
                x = torch.randn(args.batch, 32, generator=gen)
                y = torch.tanh(x @ target)
                last = m == args.microbatches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.mse_loss(model(x), y) / args.microbatches
                    loss.backward()
                total += loss.item()
            opt.step()
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(total, 6), "tp_rank": tp_rank, "dp_rank": dp_rank}
            if log and args.checksums:
                with torch.no_grad():
                    rec["params"] = round(sum(float(q.double().sum()) for q in
                                              model.parameters()), 6)
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
    # DDP's reducer after a backward that ran autograd Functions of our own
    # can deadlock gloo's threads at exit (pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
