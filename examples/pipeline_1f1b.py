#!/usr/bin/env python3
"""Pure pipeline parallelism over gloo on the CPU, Megatron's way: one stage
per rank, each holding a contiguous run of residual MLP blocks (the first
stage the input layer too, the last the head and the loss), micro-batches
scheduled one-forward-one-backward (1F1B: `world - rank - 1` warm-up
forwards, then a forward and a backward in turn, then the cool-down
backwards), activations and their gradients sent between neighbouring
stages with `batch_isend_irecv` where a send and a receive go together, as
Megatron's p2p_communication does. After the last backward the stages
all-reduce their squared gradient norms to clip by the model's global norm
(Megatron's `clip_grad_norm` over the model-parallel group), then step. No
data parallelism: every rank is a stage, and the only collective is that
norm. A job shape Greyhound's rules were not written around (its corpus
records it as held out):

    torchrun --nproc-per-node 3 examples/pipeline_1f1b.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
stage, blocks (this stage's), loss (the last stage's mean over the
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

FEATURES, CLASSES = 64, 10
# The labels: a fixed random linear teacher's choice, so that the job learns.
TEACHER = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


def build(width: int, depth: int, seed: int) -> list[nn.Module]:
    """The whole model as a list of layers: input, `depth` blocks, head."""
    torch.manual_seed(seed)
    return [nn.Linear(FEATURES, width), *(Block(width) for _ in range(depth)),
            nn.Linear(width, CLASSES)]


def stage_layers(layers: list[nn.Module], stage: int, stages: int) -> list[nn.Module]:
    """A stage's share: the blocks split as evenly as they go (the earlier
    stages take the remainder), the input layer on the first, the head on
    the last."""
    blocks = layers[1:-1]
    per, extra = divmod(len(blocks), stages)
    lo = stage * per + min(stage, extra)
    hi = lo + per + (stage < extra)
    return ([layers[0]] if stage == 0 else []) + blocks[lo:hi] + \
        ([layers[-1]] if stage == stages - 1 else [])


def batch(seed: int, step: int, mb: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `mb` of step `step`: the same on every stage (the first
    uses its inputs, the last its labels, the teacher's)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009) + mb)
    x = torch.randn(size, FEATURES, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def clip_and_step(params: list[nn.Parameter], opt, norm_sq: torch.Tensor, max_norm: float):
    total = float(norm_sq) ** 0.5
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for q in params:
            q.grad.mul_(scale)
    opt.step()
    return total


def reference(steps: int, width: int, depth: int, microbatches: int, mb_size: int,
              seed: int = 0) -> list[float]:
    """The same training in one process: each step's mean loss."""
    model = nn.Sequential(*build(width, depth, seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(microbatches):
            x, y = batch(seed, step, m, mb_size)
            loss = F.cross_entropy(model(x), y) / microbatches
            loss.backward()
            total += loss.item()
        params = list(model.parameters())
        clip_and_step(params, opt, sum((q.grad.double() ** 2).sum() for q in params), 1.0)
        out.append(total)
    return out


class Stage:
    """One rank's stage and its 1F1B schedule."""

    def __init__(self, args, rank: int, world: int):
        self.rank, self.world, self.args = rank, world, args
        self.first, self.last = rank == 0, rank == world - 1
        self.layers = nn.Sequential(*stage_layers(build(args.width, args.depth, args.seed),
                                                  rank, world))
        self.blocks = sum(isinstance(m, Block) for m in self.layers)
        self.params = list(self.layers.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.05)
        self.shape = (args.mb_size, args.width)

    # -- point to point (to the previous and the next stage) -----------------

    def _p2p(self, send=None, to=None, recv_from=None) -> torch.Tensor | None:
        ops, buf = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), to))
        if recv_from is not None:
            buf = torch.empty(self.shape)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return buf

    def recv_forward(self):
        return None if self.first else self._p2p(recv_from=self.rank - 1)

    def send_forward(self, y):
        if not self.last:
            self._p2p(send=y, to=self.rank + 1)

    def recv_backward(self):
        return None if self.last else self._p2p(recv_from=self.rank + 1)

    def send_backward(self, g):
        if not self.first:
            self._p2p(send=g, to=self.rank - 1)

    def send_forward_recv_backward(self, y):
        if self.last:
            return None
        return self._p2p(send=y, to=self.rank + 1, recv_from=self.rank + 1)

    def send_backward_recv_forward(self, g):
        if self.first:
            return None
        return self._p2p(send=g, to=self.rank - 1, recv_from=self.rank - 1)

    # -- compute ---------------------------------------------------------------

    def forward(self, step: int, mb: int, x):
        inp, labels = batch(self.args.seed, step, mb, self.args.mb_size)
        if not self.first:
            inp = x.requires_grad_()
        out = self.layers(inp)
        if self.last:
            out = F.cross_entropy(out, labels) / self.args.microbatches
            self.loss += out.item()
        return inp, out

    def backward(self, saved, grad):
        inp, out = saved
        out.backward(None if self.last else grad)
        return None if self.first else inp.grad

    def step(self, step: int) -> float:
        """One iteration, 1F1B, then the global-norm clip and the update."""
        M = self.args.microbatches
        self.opt.zero_grad(set_to_none=True)
        self.loss = 0.0
        warm = min(self.world - self.rank - 1, M)
        saved, fwd = [], 0
        for _ in range(warm):
            x = self.recv_forward()
            saved.append(self.forward(step, fwd, x))
            fwd += 1
            self.send_forward(saved[-1][1])
        x = self.recv_forward() if M > warm else None
        for i in range(M - warm):
            saved.append(self.forward(step, fwd, x))
            fwd += 1
            g = self.send_forward_recv_backward(saved[-1][1])
            gx = self.backward(saved.pop(0), g)
            if i == M - warm - 1:
                self.send_backward(gx)
            else:
                x = self.send_backward_recv_forward(gx)
        for _ in range(warm):
            g = self.recv_backward()
            self.send_backward(self.backward(saved.pop(0), g))
        norm_sq = sum((q.grad.double() ** 2).sum() for q in self.params)
        dist.all_reduce(norm_sq)
        return clip_and_step(self.params, self.opt, norm_sq, 1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--microbatches", type=int, default=6, help="micro-batches per step")
    p.add_argument("--mb-size", type=int, default=32, help="samples per micro-batch")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=6, help="residual blocks, over all stages")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this stage's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = Stage(args, rank, world)
    if rank == 0:
        print(f"{world} stages, {args.microbatches} micro-batches of {args.mb_size}, 1F1B",
              flush=True)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            norm = stage.step(step)
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "stage": rank, "blocks": stage.blocks,
                   "loss": round(stage.loss, 6) if stage.last else None,
                   "grad_norm": round(norm, 6)}
            if log and args.checksums:
                with torch.no_grad():
                    rec["params"] = round(sum(float(q.double().sum()) for q in stage.params), 9)
            if log:
                log.write(json.dumps(rec) + "\n")
            if stage.last and (step + 1) % 50 == 0:
                print(f"step {step + 1}: loss {stage.loss:.4f}", flush=True)
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
