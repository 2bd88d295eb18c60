#!/usr/bin/env python3
"""Sequence parallelism as DeepSpeed-Ulysses (Jacobs et al., 2023) over
gloo on the CPU: every rank holds one chunk of each long sequence, and each
attention layer exchanges its queries, keys and values by an all-to-all so
that every rank then holds the *whole* sequence for a subset of the heads,
computes attention over it, and sends the result back by a second
all-to-all (heads gathered, sequence scattered again). The backward runs
the two exchanges in reverse. DDP then all-reduces the weights' gradients
(each rank's are its chunk's). So a step is two all-to-alls per layer each
way, compute between them, and DDP's buckets at the end; every rank's work
is the same (a bidirectional encoder trained on masked tokens). A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/ulysses_attention.py
    sudo greyhound-trace attach <torchrun's PID>

The heads must divide among the ranks (12 by default: 2, 3, 4 or 6 ranks).
--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns,
loss), with --checksums `params` (this rank's parameters) and, at the
first step, `ulysses_error`: the largest difference between the
sequence-parallel attention (output and input gradients) and attention
over the whole sequence gathered on one rank.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector


class _Exchange(torch.autograd.Function):
    """All-to-all of x's first dimension, one equal slice per rank: slice w
    goes to rank w, and slot r of the result came from rank r. Its own
    inverse, so the backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Exchange.apply(grad)


def _exchange(x: torch.Tensor) -> torch.Tensor:
    return _Exchange.apply(x)


def ulysses_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v over every rank's chunk of the sequence,
    q, k and v of shape (batch, heads, chunk, dim), heads a multiple of the
    world size: heads scattered and sequence gathered, attention over the
    whole sequence for this rank's heads, then back."""
    world = dist.get_world_size()
    b, h, t, d = q.shape
    # (3, b, h, t, d) -> (world, 3, b, h/world, t, d): slice w goes to rank w.
    qkv = torch.stack([q, k, v]).view(3, b, world, h // world, t, d).transpose(0, 2)
    got = _exchange(qkv.transpose(1, 2))          # (world = chunk, 3, b, h/w, t, d)
    whole = got.permute(1, 2, 3, 0, 4, 5).reshape(3, b, h // world, world * t, d)
    out = F.scaled_dot_product_attention(whole[0], whole[1], whole[2])
    # (b, h/w, world * t, d) -> (world = chunk, b, h/w, t, d): chunk w goes home.
    back = _exchange(out.view(b, h // world, world, t, d).permute(2, 0, 1, 3, 4))
    return back.permute(1, 0, 2, 3, 4).reshape(b, h, t, d)  # heads in rank order


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.n1(x)).chunk(3, -1))
        a = ulysses_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.n2(x))


class Encoder(nn.Module):
    def __init__(self, vocab: int, length: int, d: int, heads: int, layers: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab + 1, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, positions):
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def ulysses_error(rank: int, world: int, gen: torch.Generator) -> float:
    """The sequence-parallel attention against attention over the gathered
    sequence: the largest difference in the output and in q, k and v's
    gradients, on this rank's chunk."""
    shape = (2, 2 * world, 8, 4)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.double).requires_grad_()
               for _ in range(3))
    g = torch.randn(*shape, generator=gen, dtype=torch.double)
    out = ulysses_attention(q, k, v)
    mine = torch.autograd.grad(out, (q, k, v), g)
    whole = []
    for z in (q, k, v, g):
        parts = [torch.empty_like(z) for _ in range(world)]
        dist.all_gather(parts, z.detach())
        whole.append(torch.cat(parts, 2).requires_grad_())
    ref = F.scaled_dot_product_attention(*whole[:3])
    refs = torch.autograd.grad(ref, whole[:3], whole[3])
    sl = slice(8 * rank, 8 * rank + 8)
    return max(float((out - ref[:, :, sl]).detach().abs().max()),
               *(float((a - b[:, :, sl]).abs().max()) for a, b in zip(mine, refs)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (every rank's)")
    p.add_argument("--chunk", type=int, default=128, help="tokens of each sequence per rank")
    p.add_argument("--dim", type=int, default=96, help="model width")
    p.add_argument("--heads", type=int, default=12, help="a multiple of the ranks")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step, and the exchange's error")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.heads % world or args.dim % args.heads:
        p.error(f"--heads {args.heads} must be a multiple of the {world} ranks and divide "
                f"--dim {args.dim}")
    torch.manual_seed(args.seed)
    length = args.chunk * world
    net = Encoder(args.vocab, length, args.dim, args.heads, args.layers)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Every rank draws the same sequences and keeps its own chunk of them.
    gen = torch.Generator().manual_seed(args.seed)
    mine = slice(rank * args.chunk, (rank + 1) * args.chunk)
    positions = torch.arange(length)[mine].expand(args.batch, -1)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            # Sequences with structure to learn: each token follows its
            # predecessor by a fixed stride, from a random start.
            start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
            seq = (start + 5 * torch.arange(length)) % args.vocab
            masked = torch.rand(args.batch, length, generator=gen) < 0.15
            tokens = torch.where(masked, args.vocab, seq)[:, mine]
            logits = model(tokens, positions)
            m = masked[:, mine]
            loss = F.cross_entropy(logits[m], seq[:, mine][m]) if m.any() else logits.sum() * 0
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                if args.checksums:
                    row["params"] = float(parameters_to_vector(net.parameters())
                                          .detach().double().sum())
                    if step == 0:
                        row["ulysses_error"] = ulysses_error(rank, world, torch.Generator()
                                                             .manual_seed(rank))
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
