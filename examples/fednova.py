#!/usr/bin/env python3
"""FedNova over gloo on the CPU (Wang et al., 2020, "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization"): each rank
is a client with data of its own (its own number of samples and its own mix
of classes) that runs a *different, random* number of local SGD steps each
round (2 to 8 by default, drawn per round and per rank), then the round's
normalized averaging: each client's update divided by its own step count,
weighted by its share of the samples, and scaled by the weighted mean step
count. Two all-reduces a round (the weighted step counts, then the flat
normalized updates). Healthy, a different rank is the last to arrive every
round, by design: a job shape Greyhound's rules were not written around
(its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/fednova.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each round (JSON lines: rank, index, start_ns, dur_ns,
the local steps' mean loss, the rank's step count `tau`, the weighted mean
step count `tau_eff`, and the rank's sample share `share`), with
--checksums `params`: a checksum of the global model after the round (the
ranks agree).
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

CLASSES = 10
FEATURES = 64


def local_steps(seed: int, index: int, rank: int, lo: int, hi: int) -> int:
    """Round `index`'s local step count of client `rank`, in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 1_009 + rank)
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def samples(rank: int, base: int) -> int:
    """Client `rank`'s dataset size: the clients' differ."""
    return base * (rank + 2)


def client_data(rank: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-IID data: class c's inputs scatter around a centre shared by every
    client, but client `rank` draws most of its labels from two classes of
    its own."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    mine = torch.tensor([(2 * rank) % CLASSES, (2 * rank + 1) % CLASSES])
    favoured = torch.rand(n, generator=gen) < 0.7
    y = torch.where(favoured, mine[torch.randint(0, 2, (n,), generator=gen)],
                    torch.randint(0, CLASSES, (n,), generator=gen))
    x = centres[y] + 1.5 * torch.randn(n, FEATURES, generator=gen)
    return x, y


def model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, CLASSES))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="rounds (0: until killed)")
    p.add_argument("--min-local", type=int, default=2, help="fewest local steps a round")
    p.add_argument("--max-local", type=int, default=8, help="most local steps a round")
    p.add_argument("--batch", type=int, default=128, help="samples per local step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--samples", type=int, default=2048,
                   help="client r holds this x (r + 2) samples")
    p.add_argument("--lr", type=float, default=0.05, help="the clients' local SGD rate")
    p.add_argument("--truth", help="append per-round ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the global model each round")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.min_local <= args.max_local:
        p.error("--min-local must be at least 1 and at most --max-local")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(args.hidden, args.seed)
    params = list(net.parameters())
    glob = [q.detach().clone() for q in params]          # the round's global model
    n = samples(rank, args.samples)
    x, y = client_data(rank, n, args.seed)
    sizes = torch.zeros(world)
    sizes[rank] = n
    dist.all_reduce(sizes)                               # every client's sample count
    share = float(sizes[rank] / sizes.sum())
    order = torch.Generator().manual_seed(args.seed + 7 + rank)
    flat = torch.zeros(sum(q.numel() for q in params))
    opt = torch.optim.SGD(params, lr=args.lr)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            tau = local_steps(args.seed, step, rank, args.min_local, args.max_local)
            losses = []
            for _ in range(tau):
                pick = torch.randint(0, n, (args.batch,), generator=order)
                loss = F.cross_entropy(net(x[pick]), y[pick])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            # Normalized averaging: tau_eff = sum_k p_k tau_k, and the global
            # model moves by tau_eff x sum_k p_k (x0 - x_k) / tau_k.
            tau_eff = torch.tensor([share * tau], dtype=torch.float64)
            dist.all_reduce(tau_eff)
            with torch.no_grad():
                torch.cat([(g - q).reshape(-1) for g, q in zip(glob, params)], out=flat)
                flat *= share / tau
            dist.all_reduce(flat)
            with torch.no_grad():
                at = 0
                for g, q in zip(glob, params):
                    g -= float(tau_eff) * flat[at:at + g.numel()].view_as(g)
                    q.copy_(g)
                    at += g.numel()
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0,
                       "loss": round(sum(losses) / len(losses), 6), "tau": tau,
                       "tau_eff": float(tau_eff), "share": share}
                if args.checksums:
                    row["params"] = float(sum(g.double().sum() for g in glob))
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
