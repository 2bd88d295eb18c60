#!/usr/bin/env python3
"""Context parallelism by ring attention (Liu et al., 2023) over gloo on
the CPU: every rank holds one chunk of each long sequence, and each
attention layer passes the key and value chunks around the ring of ranks
(`isend` to the next, `irecv` from the previous, one round per other rank)
while it computes attention over the chunk it holds, merging the rounds'
softmaxes as flash attention does. The backward passes the chunks round
again, with their gradients. DDP then all-reduces the weights' gradients
(each rank's are its chunk's). So a step is many point-to-point rounds in
both passes, compute between them, and one collective at the end. A
bidirectional encoder trained on masked tokens (non-causal: every rank's
work is the same). A job shape Greyhound's rules were not written around
(its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/ring_attention.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns,
loss), with --checksums `params` (this rank's parameters) and, at the
first step, `ring_error`: the largest difference between the ring's
attention (output and input gradients) and attention over the whole
sequence gathered on one rank.
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector


def _pass_on(buf: torch.Tensor) -> torch.Tensor:
    """Send `buf` to the next rank on the ring, and return what the
    previous one sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(buf)
    works = [dist.isend(buf.contiguous(), (rank + 1) % world),
             dist.irecv(got, (rank - 1) % world)]
    for w in works:
        w.wait()
    return got


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v over every rank's keys and values, q, k
    and v of shape (batch, heads, chunk, dim)."""

    @staticmethod
    def forward(ctx, q, k, v):
        world, scale = dist.get_world_size(), 1.0 / math.sqrt(q.size(-1))
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=q.dtype)
        kv = torch.stack([k, v])
        for r in range(world):
            s = q @ kv[0].transpose(-1, -2) * scale
            block = torch.logsumexp(s, -1, keepdim=True)
            new = torch.logaddexp(lse, block)
            part = torch.exp(s - block) @ kv[1]            # this round's softmax, merged
            out = out * torch.exp(lse - new) + part * torch.exp(block - new)
            lse = new
            if r < world - 1:
                kv = _pass_on(kv)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        world, scale = dist.get_world_size(), 1.0 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        # The key/value chunk and its gradients so far travel together; after
        # `world` passes each chunk's gradients are home.
        state = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for _ in range(world):
            kc, vc = state[0], state[1]
            p = torch.exp(q @ kc.transpose(-1, -2) * scale - lse)
            ds = p * (dout @ vc.transpose(-1, -2) - delta) * scale
            dq += ds @ kc
            state = torch.stack([kc, vc, state[2] + ds.transpose(-1, -2) @ q,
                                 state[3] + p.transpose(-1, -2) @ dout])
            state = _pass_on(state)
        return dq, state[2], state[3]


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
        a = RingAttention.apply(q, k, v).transpose(1, 2).reshape(b, t, d)
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


def ring_error(rank: int, world: int, gen: torch.Generator) -> float:
    """The ring's attention against attention over the gathered sequence:
    the largest difference in the output and in q, k and v's gradients."""
    q, k, v = (torch.randn(2, 2, 8, 4, generator=gen, dtype=torch.double).requires_grad_()
               for _ in range(3))
    g = torch.randn(2, 2, 8, 4, generator=gen, dtype=torch.double)
    out = RingAttention.apply(q, k, v)
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
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step, and the ring's error")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
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
            seq = (start + 7 * torch.arange(length)) % args.vocab
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
                        row["ring_error"] = ring_error(rank, world, torch.Generator()
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
