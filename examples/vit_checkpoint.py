#!/usr/bin/env python3
"""A vision transformer trained under DDP over gloo on the CPU the way a
large model is: activation checkpointing on every block (each block's
forward runs again inside the backward, so the gradient buckets' all-reduces
start later and further apart), DDP's default 25 MB buckets over ~11 M
parameters, AdamW under a warm-up then cosine schedule, gradient clipping,
and timm's habit of all-reducing the loss for the log every `--log-every`
steps. An iteration takes about a second even healthy. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/vit_checkpoint.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
for the tests and benchmarks, with the step's loss, the loss last
all-reduced for the log, and with --checksums `params`: a checksum of this
rank's parameters (the replicas agree).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

IMAGE, PATCH, CLASSES = 32, 4, 10


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int):
        super().__init__()
        n = (IMAGE // PATCH) ** 2
        self.embed = nn.Conv2d(3, dim, PATCH, PATCH)
        self.pos = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, CLASSES)

    def forward(self, img):
        x = self.embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)   # recomputed in backward
        return self.head(self.norm(x[:, 0]))


def lr_at(step: int, warmup: int = 20, total: int = 2000, peak: float = 5e-4) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * min(1.0, (step - warmup) / total)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=8, help="images per rank per step")
    p.add_argument("--dim", type=int, default=384, help="the transformer's width")
    p.add_argument("--depth", type=int, default=6, help="blocks")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between the loss's all-reduce for the log")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(ViT(args.dim, args.depth, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.05)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    # A fixed synthetic dataset: the class sets a colour shift, so loss falls.
    centres = torch.randn(CLASSES, 3, 1, 1, generator=torch.Generator().manual_seed(7))
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step, logged = 0, None
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
            x = centres[y] + torch.randn(args.batch, 3, IMAGE, IMAGE, generator=gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % args.log_every == args.log_every - 1:
                mean = loss.detach().clone()
                dist.all_reduce(mean)                   # timm's reduce_tensor
                logged = mean.item() / world
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 4),
                       "logged_loss": logged}
                if args.checksums:
                    row["params"] = float(sum(q.double().sum() for q in model.parameters()))
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
