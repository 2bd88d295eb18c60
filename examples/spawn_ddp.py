#!/usr/bin/env python3
"""DDP launched the way PyTorch's DDP tutorial launches it: one script that
calls torch.multiprocessing.spawn, each child told its rank as an argument,
MASTER_ADDR and MASTER_PORT set inside the child. No process has RANK in its
environment, so Greyhound numbers the ranks in the order mp.spawn started
them (the `attach` event says `rank_from: "spawn order"`). Attach to the
script's PID, as to torchrun's:

    python examples/spawn_ddp.py --world 3 &
    sudo greyhound-trace attach $!

`--truth FILE` appends each rank's own per-iteration log (JSON lines: rank,
pid, index, start_ns, dur_ns), which the tests compare Greyhound with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    setup(rank, world, args.port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    while args.steps == 0 or step < args.steps:
        t0 = time.time_ns()
        x = torch.randn(args.batch, 256, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log:
            log.write(json.dumps({"rank": rank, "pid": os.getpid(), "index": step,
                                  "start_ns": t0, "dur_ns": time.time_ns() - t0}) + "\n")
        step += 1
    del model, opt
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3, help="ranks to spawn")
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=128, help="samples per rank per iteration")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    args = p.parse_args()
    mp.spawn(train, args=(args.world, args), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
