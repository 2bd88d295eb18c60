#!/usr/bin/env python3
"""A transformer language model trained the way fairseq's legacy
data-parallel trainer does it, over gloo on the CPU: batches built by
tokens, not sentences (`--max-tokens`; each rank draws its own sentence
lengths, so the ranks' micro-batches differ), `--update-freq` micro-batches
accumulated with no communication at all, then per update one all-reduce
of the logging statistics (tokens, sentences, loss: the sample size the
gradients are divided by) and one all-reduce of every gradient in a single
flat buffer; gradients normalised by the job's token count, clipped, Adam
under an inverse-square-root schedule. Two collectives an update, updates
seconds apart. A job shape Greyhound's rules were not written around (its
corpus records it as held out):

    torchrun --nproc-per-node 3 examples/fairseq_legacy.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each update (JSON lines: rank, index, start_ns, dur_ns)
for the tests and benchmarks, with the update's loss per token, this rank's
tokens and the job's, and with --checksums `params`: a checksum of this
rank's parameters (the replicas agree).
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

VOCAB = 2000


class LM(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(512, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        causal = nn.Transformer.generate_square_subsequent_mask(n)
        return self.out(self.layers(x, mask=causal, is_causal=True))


def batch(gen: torch.Generator, max_tokens: int) -> torch.Tensor:
    """As many sentences of one drawn length as fit in max_tokens: a
    bucket of fairseq's length-sorted batches. The text is a noisy
    counting sequence, so the loss falls."""
    length = int(torch.randint(16, 257, (1,), generator=gen))
    n = max(1, max_tokens // length)
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    seq = (start + torch.arange(length + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)


def inverse_sqrt(update: int, warmup: int = 50, peak: float = 5e-4) -> float:
    return peak * min((update + 1) / warmup, (warmup / (update + 1)) ** 0.5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="updates (0: until killed)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per micro-batch")
    p.add_argument("--update-freq", type=int, default=4, help="micro-batches per update")
    p.add_argument("--dim", type=int, default=256, help="the model's width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--truth", help="append per-update ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each update")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = LM(args.dim, args.layers)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:                    # legacy DDP: the replicas start equal
        dist.broadcast(q.data, 0)
    opt = torch.optim.Adam(params, lr=inverse_sqrt(0), betas=(0.9, 0.98), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=False)
            loss_sum, tokens, sentences = 0.0, 0, 0
            for _ in range(args.update_freq):   # no communication while accumulating
                seq = batch(gen, args.max_tokens)
                logits = model(seq[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                   seq[:, 1:].reshape(-1), reduction="sum")
                loss.backward()
                loss_sum += loss.item()
                tokens += seq[:, 1:].numel()
                sentences += len(seq)
            stats = torch.tensor([float(tokens), float(sentences), loss_sum], dtype=torch.float64)
            dist.all_reduce(stats)              # fairseq's all_reduce_dict of the logging outputs
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            dist.all_reduce(flat)               # one flat buffer, every gradient
            flat /= stats[0].item()             # the job's tokens: the loss per token
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
            torch.nn.utils.clip_grad_norm_(params, 0.1)
            for g in opt.param_groups:
                g["lr"] = inverse_sqrt(step)
            opt.step()
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0,
                       "loss": round(stats[2].item() / stats[0].item(), 4),
                       "tokens": tokens, "job_tokens": int(stats[0].item())}
                if args.checksums:
                    row["params"] = float(sum(q.detach().double().sum() for q in params))
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
