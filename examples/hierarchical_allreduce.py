#!/usr/bin/env python3
"""Data parallelism with a hierarchical all-reduce over gloo on the CPU, as
Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE` and many hand-rolled multi-node
jobs do it: the ranks are grouped into "nodes" of `--local-size`
consecutive ranks; after backward each rank's gradients go into one flat
buffer, which is summed onto the node's first rank (its leader) by a
reduce within the node, all-reduced between the leaders alone, and
broadcast back within the node. So the ranks' calls differ: a leader makes
three collectives a step, on two communicators, the others two, and they
wait in the broadcast while the leaders talk. A job shape Greyhound's rules
were not written around (its corpus records it as held out):

    torchrun --nproc-per-node 4 examples/hierarchical_allreduce.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss (this rank's own), node, leader, grad_norm (of the mean
gradient: the same on every rank), and with --checksums `params`: a
checksum of the parameters) for the tests and benchmarks.
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

CLASSES = 10


def groups(world: int, local: int):
    """Every node's group and the leaders' group, made on every rank in the
    same order (new_group is collective): nodes of `local` consecutive
    ranks, the last one smaller when `local` does not divide the world."""
    nodes = [list(range(lo, min(lo + local, world))) for lo in range(0, world, local)]
    made = [dist.new_group(n) for n in nodes]
    leaders = dist.new_group([n[0] for n in nodes])
    return nodes, made, leaders


def model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def batch(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small images whose class is set by which quadrant is brightest and by
    the colour that dominates it, so there is something to learn."""
    x = torch.randn(size, 3, 16, 16, generator=gen) * 0.5
    quad = torch.randint(0, 4, (size,), generator=gen)
    colour = torch.randint(0, 3, (size,), generator=gen)
    for i in range(size):
        r, c = divmod(int(quad[i]), 2)
        x[i, colour[i], 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 1.5
    return x, (quad * 3 + colour) % CLASSES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--width", type=int, default=16, help="the first convolution's channels")
    p.add_argument("--local-size", type=int, default=2, help="ranks per node")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes, node_groups, leaders = groups(world, args.local_size)
    node = rank // args.local_size
    leader = nodes[node][0]
    net = model(args.width, args.seed)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    flat = torch.zeros(sum(q.numel() for q in params))
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    if rank == 0:
        print(f"{world} ranks in {len(nodes)} nodes of up to {args.local_size}, "
              "hierarchical all-reduce", flush=True)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x, y = batch(gen, args.batch)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.cat([q.grad.reshape(-1) for q in params], out=flat)
            # Within the node onto its leader, between the leaders, back.
            dist.reduce(flat, dst=leader, group=node_groups[node])
            if rank == leader:
                dist.all_reduce(flat, group=leaders)
            dist.broadcast(flat, src=leader, group=node_groups[node])
            flat /= world
            at = 0
            for q in params:
                q.grad.copy_(flat[at:at + q.numel()].view_as(q))
                at += q.numel()
            opt.step()
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "node": node, "leader": rank == leader,
                       "grad_norm": round(float(flat.norm()), 6)}
                if args.checksums:
                    with torch.no_grad():
                        row["params"] = float(sum(q.double().sum() for q in params))
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
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(code)
