#!/usr/bin/env python3
"""ZeRO stage 1 over gloo on the CPU, with PyTorch's own parts: a small
transformer encoder under DDP, and `ZeroRedundancyOptimizer` around AdamW,
which keeps each rank's optimizer state for its own shard of the
parameters only. After DDP's gradient all-reduces, each rank updates its
shard and broadcasts it: one broadcast per parameter tensor every step,
from as many roots as there are ranks. Every `--log-every` steps the
ranks also all-reduce the loss for rank 0 to print, as most trainers'
logging does, so one step in that many carries one collective more. A job
shape Greyhound's rules were not written around (its corpus records it
as held out):

    torchrun --nproc-per-node 3 examples/zero_ddp.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, `logged`: whether the loss was all-reduced after it, `shard`: the
parameter tensors this rank's optimizer holds, of `tensors`, and with --checksums
`params`: a checksum of this rank's parameters) for the tests and
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
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


class Encoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step and rank")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10,
                   help="all-reduce the loss for rank 0 to print every this many steps")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    vocab = 256
    model = DDP(Encoder(vocab, args.width, args.layers, heads=4))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=1e-3)
    shard = sum(len(g["params"]) for g in opt.optim.param_groups)
    tensors = len(list(model.parameters()))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
            opt.zero_grad(set_to_none=True)
            out = model(x[:, :-1])
            loss = F.cross_entropy(out.reshape(-1, vocab), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            logged = (step + 1) % args.log_every == 0
            if logged:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                if rank == 0:
                    print(f"step {step + 1}: loss {mean.item() / world:.4f}", flush=True)
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(loss.item(), 6), "logged": logged, "shard": shard,
                   "tensors": tensors}
            if log and args.checksums:
                with torch.no_grad():
                    rec["params"] = round(sum(float(q.double().sum())
                                              for q in model.parameters()), 9)
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
    # DDP's reducer at exit can deadlock gloo's threads (pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
