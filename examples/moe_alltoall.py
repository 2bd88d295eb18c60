#!/usr/bin/env python3
"""A mixture-of-experts model with expert parallelism over gloo on the CPU:
one expert per rank, and every token goes to the expert its router picks,
wherever that expert lives. Each iteration exchanges the token counts, then
the tokens themselves (an all-to-all with uneven splits), runs the local
expert on what it received, and sends the results back; backward does the
two exchanges again in reverse while DDP all-reduces the replicated
parameters (the input layer, the router, the head), never the experts'.
No capacity limit (dropless, as MegaBlocks): a rank whose expert is picked
more computes longer that iteration and the others wait for it in the
next exchange, so which rank is slowest changes from one iteration to the
next (a load-balancing loss keeps the router near even). A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/moe_alltoall.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss, and `tokens`: how many tokens this rank's expert ran) for the
tests and benchmarks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class MoE(nn.Module):
    """Input layer, a top-1 router over `world` experts, this rank's expert,
    a residual and a head."""

    def __init__(self, inputs: int, dim: int, hidden: int, world: int):
        super().__init__()
        self.world = world
        self.inp = nn.Linear(inputs, dim)
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, world, bias=False)
        self.expert = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, 1)
        self.tokens = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(self.inp(x))
        probs = self.router(self.norm(h)).softmax(-1)
        gate, dest = probs.max(-1)
        order = dest.argsort()
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)                   # how many each expert gets
        ins, outs = send.tolist(), recv.tolist()
        self.tokens = sum(outs)
        got = dfn.all_to_all_single(h.new_empty(self.tokens, h.shape[1]), h[order], outs, ins)
        done = self.expert(got)
        back = dfn.all_to_all_single(h.new_empty(h.shape), done, ins, outs)
        y = torch.empty_like(back).index_copy(0, order, back)  # each token in its place
        y = h + gate.unsqueeze(1) * y
        # Switch Transformer's load-balancing loss: the share of tokens each
        # expert got times its mean router probability.
        share = send.float() / len(x)
        aux = self.world * (share * probs.mean(0)).sum()
        return self.head(y), aux


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per iteration")
    p.add_argument("--dim", type=int, default=128, help="the model's width")
    p.add_argument("--hidden", type=int, default=512, help="each expert's hidden width")
    p.add_argument("--aux", type=float, default=0.01, help="the load-balancing loss's weight")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = 64
    torch.manual_seed(args.seed)                 # the replicated parts start alike
    moe = MoE(inputs, args.dim, args.hidden, world)
    torch.manual_seed(args.seed * 1_000_003 + rank + 1)     # each rank's own expert
    for m in moe.expert:
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    # The experts are not replicas: DDP leaves them alone.
    DDP._set_params_and_buffers_to_ignore_for_model(
        moe, [f"expert.{n}" for n, _ in moe.expert.named_parameters()])
    model = DDP(moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.randn(inputs, 1, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 7_919 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.tokens, inputs, generator=gen)
            y = torch.tanh(x @ target)
            opt.zero_grad(set_to_none=True)
            out, aux = model(x)
            loss = F.mse_loss(out, y)
            (loss + args.aux * aux).backward()
            opt.step()
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(loss.item(), 5), "tokens": moe.tokens}
            if log:
                log.write(json.dumps(rec) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave with the model alive: freeing DDP's reducer, its process group's
    # last owner, joins gloo's threads with the GIL held, while one of them
    # may wait for the GIL to free the last backward's work (it holds a
    # Python object from this backward's autograd Function): a hang at exit
    # in 2 of 10 runs (pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
