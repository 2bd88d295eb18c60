#!/usr/bin/env python3
"""Synchronous parameter-server training over gloo on the CPU: rank 0 is
the server and trains nothing; every other rank is a worker. Each step
the workers compute their gradients and push them to the server (a
gather), the server averages them and steps its optimizer, and every
worker pulls the new parameters back (a broadcast). So the ranks do not
do the same work: the server computes little and waits for the workers
most of each step, and the workers wait for the server's step. A job
shape Greyhound's rules were not written around (its corpus records it
as held out):

    torchrun --nproc-per-node 3 examples/param_server.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns,
`role`, and a worker's loss), with --checksums `params`: a checksum of
this rank's parameters after the pull (the same on every rank).
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

SERVER = 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per worker per step")
    p.add_argument("--width", type=int, default=768, help="hidden units")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        sys.exit("param_server.py: needs a server and at least one worker (2 ranks or more)")
    server = rank == SERVER
    torch.manual_seed(args.seed)             # one model everywhere at the start
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if server else None
    flat = parameters_to_vector(model.parameters()).detach().clone()
    if server:
        for q in model.parameters():
            q.grad = torch.zeros_like(q)     # the workers' mean goes here
    centers = torch.randn(10, 64, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            loss = None
            if server:
                grads = [torch.empty_like(flat) for _ in range(world)]
                dist.gather(torch.zeros_like(flat), grads, dst=SERVER)    # push
                mean = sum(grads[1:]) / (world - 1)
                vector_to_parameters(mean, [q.grad for q in model.parameters()])
                opt.step()
                flat = parameters_to_vector(model.parameters()).detach().clone()
            else:
                y = torch.randint(0, 10, (args.batch,), generator=gen)
                x = centers[y] + 3.0 * torch.randn(args.batch, 64, generator=gen)
                model.zero_grad(set_to_none=True)
                out = F.cross_entropy(model(x), y)
                out.backward()
                loss = round(out.item(), 6)
                dist.gather(parameters_to_vector(q.grad for q in model.parameters()),
                            dst=SERVER)                                     # push
            dist.broadcast(flat, src=SERVER)                                # pull
            if not server:
                vector_to_parameters(flat, model.parameters())
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "role": "server" if server else "worker",
                       "loss": loss}
                if args.checksums:
                    row["params"] = float(parameters_to_vector(model.parameters())
                                          .detach().double().sum())
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
