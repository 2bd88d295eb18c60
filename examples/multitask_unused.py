#!/usr/bin/env python3
"""Multi-task training under DDP over gloo on the CPU, the way MT-DNN-style
jobs and many detection and NLP codebases run: a shared encoder with one
head per task, each step's batch drawn from one task in turn (round robin),
so the other task's head gets no gradient that step. DDP then needs
`find_unused_parameters=True`: every step it walks the autograd graph for
the parameters left out, marks their buckets ready at once, and
all-reduces its map of the parameters each rank used (one more small
collective a step). Adam, gradient clipping, and the two tasks' losses
all-reduced for the log every `--log-every` steps. A job shape Greyhound's
rules were not written around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/multitask_unused.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
with its task and loss, and with --checksums `params`: a checksum of this
rank's parameters (the replicas agree).
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
from torch.nn.parallel import DistributedDataParallel as DDP

IN, CLASSES, TARGETS = 128, 16, 8


class MultiTask(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width),
                                     nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.heads = nn.ModuleDict({
            "classify": nn.Sequential(nn.Linear(width, width), nn.ReLU(),
                                      nn.Linear(width, CLASSES)),
            "regress": nn.Sequential(nn.Linear(width, width), nn.ReLU(),
                                     nn.Linear(width, TARGETS))})

    def forward(self, x, task: str):
        return self.heads[task](self.encoder(x))


def batch(task: str, n: int, gen: torch.Generator, proj: torch.Tensor):
    x = torch.randn(n, IN, generator=gen)
    if task == "classify":
        return x, (x @ proj[:, :CLASSES]).argmax(1)
    return x, torch.tanh(x @ proj[:, CLASSES:CLASSES + TARGETS])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--width", type=int, default=512, help="the encoder's and heads' width")
    p.add_argument("--log-every", type=int, default=20,
                   help="steps between the tasks' losses all-reduced for the log")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(MultiTask(args.width), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    proj = torch.randn(IN, CLASSES + TARGETS, generator=torch.Generator().manual_seed(11))
    tasks = ("classify", "regress")
    recent = {t: 0.0 for t in tasks}
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step, logged = 0, None
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            task = tasks[step % 2]                  # round robin over the tasks
            x, y = batch(task, args.batch, gen, proj)
            opt.zero_grad(set_to_none=True)
            out = model(x, task)
            loss = (nn.functional.cross_entropy(out, y) if task == "classify"
                    else nn.functional.mse_loss(out, y))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent[task] = loss.item()
            if step % args.log_every == args.log_every - 1:
                both = torch.tensor([recent[t] for t in tasks])
                dist.all_reduce(both)               # the tasks' mean losses for the log
                logged = [round(v / world, 6) for v in both.tolist()]
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "task": task,
                       "loss": round(loss.item(), 6), "logged": logged}
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
