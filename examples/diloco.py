#!/usr/bin/env python3
"""DiLoCo over gloo on the CPU (Douillard et al., 2023; OpenDiLoCo): each
rank trains its own copy of a small transformer language model for `--inner`
steps with AdamW and no communication at all, then one outer step: the
pseudo-gradient (the global parameters minus the rank's own) averaged over
the ranks in one all-reduce of a flat buffer, and applied to the global
parameters by an outer SGD with Nesterov momentum, which every rank then
trains on. One collective per outer step, seconds of compute between: a
job shape Greyhound's rules were not written around (its corpus records it
as held out):

    torchrun --nproc-per-node 3 examples/diloco.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each outer step (JSON lines: rank, index, start_ns,
dur_ns, the inner steps' mean loss, and the pseudo-gradient's norm), with
--checksums `params`: a checksum of the global parameters after the outer
step (the ranks agree).
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

VOCAB = 512


class LM(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x):
        n = x.shape[1]
        return self.out(self.body(self.embed(x) + self.pos[:n], mask=self.mask[:n, :n],
                                  is_causal=True))


def batch(gen: torch.Generator, size: int, context: int) -> torch.Tensor:
    """Sequences of a noisy repeating pattern (so the model has something to
    learn), each rank drawing its own."""
    period = torch.randint(2, 9, (size, 1), generator=gen)
    base = torch.randint(0, VOCAB, (size, 8), generator=gen)
    idx = torch.arange(context + 1)[None, :] % period
    seq = base.gather(1, idx)
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="outer steps (0: until killed)")
    p.add_argument("--inner", type=int, default=8, help="inner steps per outer step")
    p.add_argument("--batch", type=int, default=8, help="sequences per inner step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--truth", help="append per-outer-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the global parameters each outer step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = LM(args.dim, args.layers, context=args.context)
    params = [q for q in model.parameters()]
    # The global parameters and their outer optimizer (every rank holds the
    # same); the model is each rank's own copy between outer steps.
    glob = [q.detach().clone().requires_grad_(True) for q in params]
    outer = torch.optim.SGD(glob, lr=args.outer_lr, momentum=0.9, nesterov=True)
    inner = torch.optim.AdamW(params, lr=args.inner_lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    flat = torch.zeros(sum(q.numel() for q in params))
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            losses = []
            for _ in range(args.inner):
                seq = batch(gen, args.batch, args.context)
                loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB),
                                       seq[:, 1:].reshape(-1))
                inner.zero_grad(set_to_none=True)
                loss.backward()
                inner.step()
                losses.append(loss.item())
            # The outer step: the mean pseudo-gradient, in one all-reduce.
            with torch.no_grad():
                torch.cat([(g - q).reshape(-1) for g, q in zip(glob, params)], out=flat)
            dist.all_reduce(flat)
            flat /= world
            at = 0
            for g in glob:
                g.grad = flat[at:at + g.numel()].view_as(g).clone()
                at += g.numel()
            outer.step()
            with torch.no_grad():
                for g, q in zip(glob, params):
                    q.copy_(g)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0,
                       "loss": round(sum(losses) / len(losses), 6),
                       "pseudo_norm": round(float(flat.norm()), 6)}
                if args.checksums:
                    row["params"] = float(sum(g.detach().double().sum() for g in glob))
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
