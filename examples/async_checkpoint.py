#!/usr/bin/env python3
"""Data-parallel training that checkpoints asynchronously, as torchtitan
does: every `--ckpt-every` steps the model's and the optimizer's state
(`get_state_dict`) goes to `torch.distributed.checkpoint.async_save` on a
process group of its own (gloo), which stages it and writes it from a
background thread, with that thread's own collectives (the save plan
gathered and scattered, the metadata's at the end), while the training
thread goes on with DDP's gradient all-reduces. The previous save must have
finished before the next begins (`future.result()`), and the two latest
finished checkpoints are kept besides the one being written. So two threads of each rank issue collectives on two
groups, their order between them differing from save to save: a job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/async_checkpoint.py
    sudo greyhound-trace attach <torchrun's PID>

The model is a small residual MLP over class-dependent inputs. --truth FILE
logs each iteration (JSON lines: rank, index, start_ns, dur_ns, loss, and
`saved`: the step whose save began this iteration), with --checksums
`params` (this rank's parameters: the replicas agree).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, CLASSES, KEEP = 64, 10, 2


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model(width: int, depth: int) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, width), *[Block(width) for _ in range(depth)],
                         nn.LayerNorm(width), nn.Linear(width, CLASSES))


def checksum(net: nn.Module) -> float:
    return float(sum(q.detach().double().sum() for q in net.parameters()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=20, help="begin a save every N steps")
    p.add_argument("--ckpt-dir", help="where the checkpoints go (default: a directory of "
                   "this user's in the temporary directory, emptied at start)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_pg = dist.new_group(backend="gloo")      # the saves' own group, as torchtitan's
    root = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / f"async_checkpoint-{os.getuid()}")
    if args.ckpt_dir is None and rank == 0:
        # Ours: a run killed before its end left its checkpoints (no save
        # begins before rank 0 has trained with the others).
        shutil.rmtree(root, ignore_errors=True)
    torch.manual_seed(args.seed)
    net = DDP(model(args.width, args.depth))
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)   # each rank its own data
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(args.seed))
    log = open(args.truth, "a", buffering=1) if args.truth else None
    future, saved = None, []
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
            x = centres[y] + 3 * torch.randn(args.batch, FEATURES, generator=gen)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            began = None
            if step % args.ckpt_every == args.ckpt_every - 1:
                if future is not None:
                    future.result()               # one save at a time
                    if rank == 0:
                        while len(saved) > KEEP:
                            shutil.rmtree(saved.pop(0), ignore_errors=True)
                model_sd, optim_sd = get_state_dict(net, opt)
                where = root / f"step-{step}"
                future = dcp.async_save({"model": model_sd, "optim": optim_sd, "step": step},
                                        checkpoint_id=str(where), process_group=ckpt_pg)
                saved.append(where)
                began = step
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "saved": began}
                if args.checksums:
                    row["params"] = checksum(net)
                log.write(json.dumps(row) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    if future is not None:
        future.result()
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
