#!/usr/bin/env python3
"""A small transformer language model under DDP over gloo on the CPU, fed
sequences of varying length with no length bucketing across ranks: every
iteration, each rank draws its own batch's length (log-normal, as text
is), pads to it, and computes for it. So a different rank is the slowest
at each iteration, often by 2-3x, and the others wait for it in the
all-reduce: healthy ranks that take turns at looking like stragglers.
A detector must name a rank that is slow over time, never the one that
drew the longest batch. A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/varlen_lm.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, and `tokens`: the batch's length) for the tests and benchmarks.
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
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                           batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        h = self.embed(tokens) + self.pos(pos)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.body(h, mask=causal, src_key_padding_mask=pad,
                                   is_causal=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per iteration")
    p.add_argument("--median-len", type=int, default=48, help="the median sequence length")
    p.add_argument("--max-len", type=int, default=192, help="longer sequences are cut here")
    p.add_argument("--width", type=int, default=128, help="the model's width")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(TinyLM(args.vocab, args.width, args.layers, args.max_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            # Each sequence's length is log-normal (sigma 0.6: the spread of
            # sentence-to-paragraph text); the batch pads to its longest.
            z = torch.randn(args.batch, generator=gen)
            lengths = (args.median_len * torch.exp(0.6 * z)).clamp(4, args.max_len).long()
            n = int(lengths.max())
            tokens = torch.randint(0, args.vocab, (args.batch, n + 1), generator=gen)
            pad = torch.arange(n + 1).unsqueeze(0) >= lengths.unsqueeze(1) + 1
            logits = model(tokens[:, :-1], pad[:, :-1])
            target = tokens[:, 1:].masked_fill(pad[:, 1:], -100)
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                               target.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            loss = loss.item()
            opt.step()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0, "tokens": n,
                                      "loss": round(loss, 4)
                                      if math.isfinite(loss) else None}) + "\n")
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
