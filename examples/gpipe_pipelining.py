#!/usr/bin/env python3
"""Pipeline parallelism with PyTorch's own `torch.distributed.pipelining`, as
torchtitan uses it, over gloo on the CPU: a small transformer language model
cut into one stage per rank (the first holds the embeddings, the last the
final norm, the head and the loss), each wrapped in a `PipelineStage`, and a
step run by `ScheduleGPipe`: all the micro-batches' forwards, then all their
backwards, the activations and their gradients passed between neighbouring
stages by the library's own sends and receives. After the schedule the
stages clip by the model's global gradient norm (one all-reduce of their
squared norms, torchtitan's `clip_grad_norm_` over the pipeline group) and
step AdamW. No data parallelism: every rank is a stage. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/gpipe_pipelining.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
stage, layers (this stage's), loss (the last stage's mean over the
micro-batches, null elsewhere), grad_norm, and with --checksums `params`: a
checksum of this stage's parameters) for the tests and benchmarks.
`reference(...)` trains the same model in one process, for the tests.
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
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

VOCAB = 256


class Layer(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class Part(nn.Module):
    """A stage's part of the model: the embeddings on the first, a run of
    layers, the final norm and head on the last (None elsewhere)."""

    def __init__(self, layers: list[nn.Module], embed=None, pos=None, norm=None, head=None):
        super().__init__()
        self.embed, self.pos = embed, pos
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n] if self.embed is not None else x
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(self.norm(h)) if self.head is not None else h


def parts(dim: int, depth: int, context: int, stages: int, seed: int) -> list[Part]:
    """The whole model, built once with one seed (the same on every rank),
    cut into `stages` parts, the layers as evenly as they go (the earlier
    stages take the remainder)."""
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, dim)
    pos = nn.Parameter(torch.randn(context, dim) * 0.02)
    layers = [Layer(dim) for _ in range(depth)]
    norm, head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)
    per, extra = divmod(depth, stages)
    out, lo = [], 0
    for s in range(stages):
        hi = lo + per + (s < extra)
        first, last = s == 0, s == stages - 1
        out.append(Part(layers[lo:hi], embed if first else None, pos if first else None,
                        norm if last else None, head if last else None))
        lo = hi
    return out


def batch(seed: int, step: int, size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s sequences (a noisy repeating pattern, so there is
    something to learn) and their next tokens: the same on every stage (the
    first uses the inputs, the last the targets)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    period = torch.randint(2, 9, (size, 1), generator=g)
    base = torch.randint(0, VOCAB, (size, 8), generator=g)
    seq = base.gather(1, torch.arange(context + 1)[None, :] % period)
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def clip(params: list[nn.Parameter], norm_sq: torch.Tensor, max_norm: float) -> float:
    total = float(norm_sq) ** 0.5
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for q in params:
            q.grad.mul_(scale)
    return total


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def finish_step(params: list[nn.Parameter], opt: torch.optim.Optimizer,
                losses: list[torch.Tensor], last: bool) -> tuple[float, float | None]:
    """After the schedule: clip by the model's global gradient norm (one
    all-reduce of the ranks' squared norms), step, and return that norm and
    the step's loss (the mean over the micro-batches on the rank holding
    the last stage; None elsewhere)."""
    norm_sq = sum((q.grad.double() ** 2).sum() for q in params)
    dist.all_reduce(norm_sq)
    norm = clip(params, norm_sq, 1.0)
    opt.step()
    return norm, float(torch.stack(losses).detach().mean()) if last else None


def step_record(rank: int, step: int, t0: int, loss: float | None, norm: float,
                params: list[nn.Parameter], checksums: bool, **where) -> str:
    """One step's line of the truth log: `where` says which stages the rank
    holds; with `checksums`, a checksum of its parameters."""
    rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
           **where, "loss": round(loss, 6) if loss is not None else None,
           "grad_norm": round(norm, 6)}
    if checksums:
        with torch.no_grad():
            rec["params"] = round(sum(float(q.double().sum()) for q in params), 9)
    return json.dumps(rec) + "\n"


def reference(steps: int, dim: int, depth: int, context: int, batch_size: int,
              microbatches: int, stages: int, seed: int = 0) -> list[float]:
    """The same training in one process: each step's loss, the mean over
    the micro-batches (what the schedule's last stage reports)."""
    model = nn.Sequential(*parts(dim, depth, context, stages, seed))
    params = list(model.parameters())
    opt = optimizer(params)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(seed, step, batch_size, context)
        losses = [loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(microbatches),
                                                           y.chunk(microbatches))]
        loss = torch.stack(losses).mean()
        loss.backward()
        clip(params, sum((q.grad.double() ** 2).sum() for q in params), 1.0)
        opt.step()
        out.append(float(loss.detach()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=6, help="transformer layers, over all stages")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this stage's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    part = parts(args.dim, args.depth, args.context, world, args.seed)[rank]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, args.microbatches, loss_fn=loss_fn)
    params = list(part.parameters())
    opt = optimizer(params)
    if first:
        print(f"{world} stages, {args.microbatches} micro-batches of "
              f"{args.batch // args.microbatches}, GPipe", flush=True)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            x, y = batch(args.seed, step, args.batch, args.context)
            losses: list[torch.Tensor] = []
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            norm, loss = finish_step(params, opt, losses, last)
            if log:
                log.write(step_record(rank, step, t0, loss, norm, params, args.checksums,
                                      stage=rank, layers=len(part.layers)))
            if last and (step + 1) % 50 == 0:
                print(f"step {step + 1}: loss {loss:.4f}", flush=True)
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
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(code)
