#!/usr/bin/env python3
"""CLIP-style contrastive training under DDP: an image encoder and a text
encoder in one model, their features of every rank's batch gathered in the
forward pass, so that each rank's loss contrasts its pairs with the whole
job's (as open_clip does by default: the gathered features carry no
gradient, each rank's own chunk is its local features, which do). So the
ranks meet twice in the forward (two all-gathers, before any gradient) and
again in the backward (DDP's gradient all-reduces), and the contrastive
loss costs each rank time in proportion to the job's whole batch. The CPU
over gloo. A job shape Greyhound's rules were not written around (its
corpus records it as held out):

    torchrun --nproc-per-node 3 examples/clip_contrastive.py
    sudo greyhound-trace attach <torchrun's PID>

The pairs are synthetic: each is one of --classes concepts, its "image" a
noisy view of the concept's prototype vector and its "caption" a bag of
tokens drawn from the concept's own words, so matching them can be
learnt. --truth FILE logs each step (JSON lines: rank, index, start_ns,
dur_ns, loss, accuracy (image-to-caption, over the whole job's batch),
and with --checksums `params`: a checksum of this rank's parameters) for
the tests and benchmarks.
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

IMAGE = 256
VOCAB = 1024
WORDS = 12            # tokens per caption


class Clip(nn.Module):
    def __init__(self, width: int, dim: int):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(IMAGE, width), nn.GELU(), nn.Linear(width, width),
                                   nn.GELU(), nn.Linear(width, dim))
        self.text = nn.EmbeddingBag(VOCAB, width, mode="mean")
        self.text_proj = nn.Sequential(nn.GELU(), nn.Linear(width, dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, captions: torch.Tensor):
        img = F.normalize(self.image(images), dim=-1)
        txt = F.normalize(self.text_proj(self.text(captions)), dim=-1)
        return img, txt, self.logit_scale.exp().clamp(max=100)


def gather(local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Every rank's features, this rank's own chunk the local tensor (which
    keeps its gradient); the others' gathered without one."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous())
    parts[rank] = local
    return torch.cat(parts)


class Pairs:
    """Concepts, each a prototype image vector and a few words of its own."""

    def __init__(self, classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(classes, IMAGE, generator=g)
        self.words = torch.randint(VOCAB, (classes, 8), generator=g)

    def draw(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randint(len(self.prototypes), (n,), generator=gen)
        images = self.prototypes[c] + 0.8 * torch.randn(n, IMAGE, generator=gen)
        pick = torch.randint(self.words.shape[1], (n, WORDS), generator=gen)
        noise = torch.randint(VOCAB, (n, WORDS), generator=gen)
        keep = torch.rand(n, WORDS, generator=gen) < 0.7
        captions = torch.where(keep, self.words[c].gather(1, pick), noise)
        return images, captions


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return round(sum(float(p.double().sum()) for p in model.parameters()), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=128, help="pairs per step and rank")
    p.add_argument("--width", type=int, default=384, help="the encoders' hidden width")
    p.add_argument("--dim", type=int, default=64, help="the shared feature space's size")
    p.add_argument("--classes", type=int, default=256, help="concepts the pairs show")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(Clip(args.width, args.dim))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = Pairs(args.classes, args.seed)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    # This rank's pairs are rows [rank * batch, (rank + 1) * batch) of the
    # job's logits: its labels, against every rank's captions.
    labels = torch.arange(args.batch) + rank * args.batch
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            images, captions = data.draw(args.batch, gen)
            img, txt, scale = model(images, captions)
            all_img, all_txt = gather(img, rank, world), gather(txt, rank, world)
            logits_img = scale * img @ all_txt.T        # my images, everyone's captions
            logits_txt = scale * txt @ all_img.T        # my captions, everyone's images
            loss = (F.cross_entropy(logits_img, labels) + F.cross_entropy(logits_txt, labels)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log:
                acc = (logits_img.argmax(1) == labels).float().mean().item()
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "accuracy": round(acc, 4)}
                if args.checksums:
                    rec["params"] = checksum(model)
                log.write(json.dumps(rec) + "\n")
            if rank == 0 and (step + 1) % 500 == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
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
