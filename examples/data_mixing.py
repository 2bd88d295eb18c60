#!/usr/bin/env python3
"""Online data mixing under DDP over gloo on the CPU, as DoReMi-style and
curriculum trainers run it: the training data comes from `--domains`
domains, each rank draws its batch's samples from them by the current
mixture weights, and after every step the ranks' per-domain losses are
gathered with `all_gather_object` (pickled Python dicts: an all-gather of
their sizes, then one of their bytes), rank 0 alone updates the weights by
exponentiated gradient towards the domains whose running loss is
highest, and `broadcast_object_list` sends them to every rank (two
broadcasts) before the next step's sampling. So each step makes DDP's
gradient all-reduce and four small object collectives, two of them waiting
on rank 0's decision. A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/data_mixing.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
loss, weights (those the step sampled by), losses (every rank's
per-domain mean losses, as gathered), and with --checksums `params`: a
checksum of this rank's parameters) for the tests and benchmarks.
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

CLASSES = 8
FEATURES = 32


def domains(n: int, seed: int) -> list[tuple[torch.Tensor, float]]:
    """Each domain's linear teacher and its label noise: some easy, some
    hard, so the mixture has something to move towards."""
    g = torch.Generator().manual_seed(seed + 7)
    return [(torch.randn(FEATURES, CLASSES, generator=g), 0.05 + 0.3 * d / max(1, n - 1))
            for d in range(n)]


def sample(doms, weights: list[float], size: int, gen: torch.Generator):
    """`size` samples, each from a domain drawn by `weights`."""
    which = torch.multinomial(torch.tensor(weights), size, replacement=True, generator=gen)
    x = torch.randn(size, FEATURES, generator=gen)
    y = torch.empty(size, dtype=torch.long)
    for d, (teacher, noise) in enumerate(doms):
        idx = (which == d).nonzero().flatten()
        if len(idx):
            logits = x[idx] @ teacher
            flip = torch.rand(len(idx), generator=gen) < noise
            rand = torch.randint(0, CLASSES, (len(idx),), generator=gen)
            y[idx] = torch.where(flip, rand, logits.argmax(1))
    return x, y, which


def update(weights: list[float], gathered: list[dict], reference: list[float],
           eta: float = 0.05, floor: float = 0.05) -> tuple[list[float], list[float]]:
    """Rank 0's step: each domain's mean loss over the ranks that drew it
    folded into its running loss (`reference`), the weights moved by
    exponentiated gradient towards the domains whose running loss is over
    the domains' mean, and mixed with a uniform floor. Returns the new
    weights and the new running losses."""
    n = len(weights)
    new_ref = []
    for d in range(n):
        seen = [g[str(d)] for g in gathered if str(d) in g]
        mean = sum(seen) / len(seen) if seen else reference[d]
        new_ref.append(0.9 * reference[d] + 0.1 * mean)
    avg = sum(new_ref) / n
    logits = [math.log(weights[d]) + eta * (new_ref[d] - avg) for d in range(n)]
    top = max(logits)
    w = [math.exp(v - top) for v in logits]
    total = sum(w)
    return [(1 - floor) * v / total + floor / n for v in w], new_ref


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--domains", type=int, default=4)
    p.add_argument("--batch", type=int, default=128, help="samples per step and rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(),
                              nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                              nn.Linear(args.hidden, CLASSES)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    doms = domains(args.domains, args.seed)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    weights = [1.0 / args.domains] * args.domains
    reference = [math.log(CLASSES)] * args.domains
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, {args.domains} domains, online mixing",
              flush=True)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x, y, which = sample(doms, weights, args.batch, gen)
            per = F.cross_entropy(model(x), y, reduction="none")
            loss = per.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            per = per.detach()
            mine = {str(d): float(per[which == d].mean()) for d in range(args.domains)
                    if (which == d).any()}
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            used = weights
            box = [update(weights, gathered, reference) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            weights, reference = box[0]
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "weights": used, "losses": gathered}
                if args.checksums:
                    with torch.no_grad():
                        rec["params"] = float(sum(q.double().sum()
                                                  for q in model.parameters()))
                log.write(json.dumps(rec) + "\n")
            if rank == 0 and (step + 1) % 100 == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}, weights "
                      + " ".join(f"{w:.2f}" for w in weights), flush=True)
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
