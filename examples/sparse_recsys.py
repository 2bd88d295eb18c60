#!/usr/bin/env python3
"""A recommender with sparse embedding gradients under DDP: neural
collaborative filtering (He et al., 2017), as recommendation code writes it
when its tables are too large for dense gradients. User and item embeddings
with `sparse=True` (their gradients are sparse tensors, which DDP
all-reduces on their own, one per table: gloo gathers every rank's rows,
an allgather of the sizes then allgathervs of the indices and values), a
small MLP tower in the usual dense buckets, SparseAdam for the tables and
Adam for the tower, four sampled negatives per positive; every
`--eval-every` steps each rank scores its held-out users and the hit counts
are all-reduced (HR@10). A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/sparse_recsys.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
with its loss, the latest hit rate, and with --checksums `params`: a
checksum of this rank's parameters (the replicas agree).
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


class NCF(nn.Module):
    """Generalised matrix factorisation and an MLP over the two embeddings."""

    def __init__(self, users: int, items: int, dim: int):
        super().__init__()
        self.user = nn.Embedding(users, 2 * dim, sparse=True)
        self.item = nn.Embedding(items, 2 * dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, dim))
        self.out = nn.Linear(2 * dim, 1)
        self.dim = dim
        for e in (self.user, self.item):
            nn.init.normal_(e.weight, std=0.01)

    def forward(self, u, i):
        eu, ei = self.user(u), self.item(i)
        d = self.dim
        gmf = eu[:, :d] * ei[:, :d]
        mlp = self.mlp(torch.cat([eu[:, d:], ei[:, d:]], dim=1))
        return self.out(torch.cat([gmf, mlp], dim=1)).squeeze(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--users", type=int, default=60_000)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16, help="embedding size (each table: twice)")
    p.add_argument("--batch", type=int, default=512, help="positives per rank per step")
    p.add_argument("--negatives", type=int, default=4, help="sampled negatives per positive")
    p.add_argument("--eval-every", type=int, default=40, help="steps between hit-rate checks")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(NCF(args.users, args.items, args.dim))
    net = model.module
    sparse = list(net.user.parameters()) + list(net.item.parameters())
    dense = [q for n, q in net.named_parameters() if not n.startswith(("user.", "item."))]
    opts = [torch.optim.SparseAdam(sparse, lr=0.01), torch.optim.Adam(dense, lr=1e-3)]
    # Implicit feedback from a hidden taste model: a user likes the items
    # nearest its taste; each rank reads its own users' interactions.
    world_gen = torch.Generator().manual_seed(7)
    taste_u = torch.randn(args.users, 8, generator=world_gen)
    taste_i = torch.randn(args.items, 8, generator=world_gen)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    mine = torch.arange(rank, args.users, world)
    held = mine[:64]                                # this rank's users to evaluate on
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step, hit_rate = 0, None
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            u = mine[torch.randint(0, len(mine), (args.batch,), generator=gen)]
            cand = torch.randint(0, args.items, (args.batch, 8), generator=gen)
            best = (taste_u[u].unsqueeze(1) * taste_i[cand]).sum(-1).argmax(1)
            pos = cand[torch.arange(args.batch), best]
            neg = torch.randint(0, args.items, (args.batch * args.negatives,), generator=gen)
            users = torch.cat([u, u.repeat(args.negatives)])
            items = torch.cat([pos, neg])
            labels = torch.cat([torch.ones(args.batch), torch.zeros(len(neg))])
            for o in opts:
                o.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(users, items), labels)
            loss.backward()
            for o in opts:
                o.step()
            if step % args.eval_every == args.eval_every - 1:
                with torch.no_grad():
                    cands = torch.randint(0, args.items, (len(held), 100), generator=gen)
                    truth = (taste_u[held].unsqueeze(1) * taste_i[cands]).sum(-1).argmax(1)
                    scores = net(held.repeat_interleave(100), cands.reshape(-1)).view(-1, 100)
                    top = scores.topk(10, dim=1).indices
                    hits = torch.tensor([float((top == truth.unsqueeze(1)).any(1).sum()),
                                         float(len(held))])
                dist.all_reduce(hits)                   # HR@10 over every rank's users
                hit_rate = round((hits[0] / hits[1]).item(), 6)
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "hit_rate": hit_rate}
                if args.checksums:
                    row["params"] = float(sum(q.detach().double().sum() for q in net.parameters()))
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
