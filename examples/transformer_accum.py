#!/usr/bin/env python3
"""A small transformer language model under DDP over gloo on the CPU, with
gradient accumulation: DDP's `no_sync()` on all but the last of `--accum`
micro-steps, so the gradients are all-reduced once per iteration after
several backward passes with no collective at all; AdamW, gradient
clipping, and every 50 steps an evaluation (a scalar all-reduce and a
barrier). A job shape Greyhound's rules were not written around (its corpus
records it as held out):

    torchrun --nproc-per-node 3 examples/transformer_accum.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
for the tests and benchmarks.
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
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, DIM, SEQ = 512, 128, 32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--accum", type=int, default=4, help="micro-steps per iteration")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-step")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, batch_first=True)
    model = DDP(nn.Sequential(nn.Embedding(VOCAB, DIM), nn.TransformerEncoder(layer, 2),
                              nn.Linear(DIM, VOCAB)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            for m in range(args.accum):
                x = torch.randint(0, VOCAB, (args.batch, SEQ), generator=gen)
                last = m == args.accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    logits = model(x).reshape(-1, VOCAB)
                    loss = nn.functional.cross_entropy(logits, x.roll(1, 1).reshape(-1))
                    (loss / args.accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 49:
                val = loss.detach().clone()
                dist.all_reduce(val)
                dist.barrier()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0}) + "\n")
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
