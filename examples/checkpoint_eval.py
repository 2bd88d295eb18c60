#!/usr/bin/env python3
"""An MLP under DDP over gloo on the CPU with the periodic phases real
training has: every `--ckpt-every` iterations rank 0 alone saves a
checkpoint (model, optimizer and `--ckpt-mb` MiB of other state, written and
fsync'ed) while the other ranks wait for it in a barrier, and every
`--eval-every` iterations every rank evaluates (no_grad forward passes,
then one all-reduce of the metric). Rank 0 is the one the others wait for
at every checkpoint, for hundreds of milliseconds: a pattern a straggler
detector must not take for a slow rank. A job shape Greyhound's rules were
not written around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/checkpoint_eval.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, and `phase`: train, checkpoint or eval) for the tests and
benchmarks. Rank 0 keeps one checkpoint, in --ckpt-dir (default:
$TMPDIR/checkpoint_eval-UID, so that runs killed with SIGKILL leave one
file there, not one each).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def save(path: Path, state: dict) -> None:
    """Write, fsync and rename: a checkpoint is whole or absent."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per iteration")
    p.add_argument("--hidden", type=int, default=512, help="the MLP's width")
    p.add_argument("--ckpt-every", type=int, default=60, help="iterations between checkpoints")
    p.add_argument("--ckpt-mb", type=int, default=150,
                   help="MiB of other state (data-loader, RNG, EMA...) in each checkpoint")
    p.add_argument("--ckpt-dir", help="where rank 0 writes its checkpoint")
    p.add_argument("--eval-every", type=int, default=150, help="iterations between evaluations")
    p.add_argument("--eval-batches", type=int, default=40, help="forward passes per evaluation")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    layers = [m for _ in range(4) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())]
    model = DDP(nn.Sequential(*layers, nn.Linear(args.hidden, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    extra = torch.zeros(args.ckpt_mb << 18)            # 4-byte floats: MiB x 2^18
    ckpt = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / f"checkpoint_eval-{os.getuid()}")
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt / "checkpoint.pt"
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, args.hidden, generator=gen)
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            phase = "train"
            if step % args.ckpt_every == args.ckpt_every - 1:
                phase = "checkpoint"
                if rank == 0:
                    extra.add_(1.0)
                    save(ckpt, {"step": step, "model": model.state_dict(),
                                "opt": opt.state_dict(), "extra": extra})
                dist.barrier()
            if step % args.eval_every == args.eval_every - 1:
                phase = "eval"
                hits = torch.zeros(1)
                with torch.no_grad():
                    for _ in range(args.eval_batches):
                        xe = torch.randn(4 * args.batch, args.hidden, generator=gen)
                        hits += (model.module(xe).argmax(1) == 0).float().mean()
                dist.all_reduce(hits)
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0, "phase": phase}) + "\n")
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
