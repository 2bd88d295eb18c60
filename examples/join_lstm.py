#!/usr/bin/env python3
"""An LSTM language model under DDP with uneven inputs: each rank's shard of
the corpus is a different size, so in every epoch the ranks run out of
batches at different steps, and DDP's `Join` context manager lets the ranks
that finished first shadow the collectives of those still training (as
sharded datasets of unequal sizes are trained). Every iteration of a rank
still training is one small all-reduce (Join's count of the ranks not yet
joined) and the gradient buckets' all-reduces; at the end of each epoch the
rank with the most data trains alone for a few steps while the others wait
for it. The CPU over gloo. A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/join_lstm.py
    sudo greyhound-trace attach <torchrun's PID>

Rank r's shard holds --batches + r * --extra batches an epoch of sequences
drawn from one Markov chain over the vocabulary (the same chain on every
rank, so there is something to learn). --truth FILE logs each step (JSON
lines: rank, index (this rank's own count of steps), epoch, start_ns,
dur_ns, loss, and with --checksums `params`: a checksum of this rank's
parameters) for the tests and benchmarks. --steps N stops after N epochs
on the rank with the most data (0: until killed); every rank then has run
the same epochs.
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
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def markov_chain(vocab: int, seed: int) -> torch.Tensor:
    """Each token's next-token distribution: a few likely successors."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=gen) * 3
    return torch.softmax(logits, dim=1)


def sequences(chain: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    seq = torch.empty(n, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(chain.shape[0], (n,), generator=gen)
    for t in range(length):
        seq[:, t + 1] = torch.multinomial(chain[seq[:, t]], 1, generator=gen).squeeze(1)
    return seq


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return round(sum(float(p.double().sum()) for p in model.parameters()), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0,
                   help="epochs of the rank with the most data (0: until killed)")
    p.add_argument("--batches", type=int, default=40, help="rank 0's batches an epoch")
    p.add_argument("--extra", type=int, default=4,
                   help="how many more batches each next rank's shard holds")
    p.add_argument("--batch", type=int, default=16, help="sequences per batch")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=20.0)
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(LM(args.vocab, 64, args.hidden))
    # Plain SGD with clipping, as PyTorch's word-language-model example: a
    # joined rank's optimizer holds no state to fall behind in, so the
    # replicas stay equal once Join re-syncs them at the end of an epoch.
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    chain = markov_chain(args.vocab, args.seed)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    # This rank's shard, drawn once; reshuffled every epoch.
    shard = sequences(chain, (args.batches + rank * args.extra) * args.batch, args.seq, gen)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = epoch = 0
    try:
        while not args.steps or epoch < args.steps:
            order = torch.randperm(len(shard), generator=gen).view(-1, args.batch)
            with Join([model]):
                for idx in order:
                    t0 = time.time_ns()
                    batch = shard[idx]
                    opt.zero_grad()
                    logits = model(batch[:, :-1])
                    loss = loss_fn(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                    opt.step()
                    if log:
                        rec = {"rank": rank, "index": step, "epoch": epoch, "start_ns": t0,
                               "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                        if args.checksums:
                            rec["params"] = checksum(model)
                        log.write(json.dumps(rec) + "\n")
                    step += 1
            if rank == 0 and (epoch + 1) % 10 == 0:
                print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
            epoch += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step, "epochs": epoch})
                  + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
