#!/usr/bin/env python3
"""A small DCGAN under DDP: two models, each its own DDP, trained in turn
every iteration on the CPU over gloo. The discriminator steps on a batch of
real and generated images at once (one forward, its gradients all-reduced),
then the generator steps through the discriminator under `no_sync` (the
discriminator's gradients stay local and are dropped; the generator's are
all-reduced). Both models have BatchNorm, and DDP broadcasts its buffers
from rank 0 at each forward: an iteration is two broadcasts and two
gradient all-reduces of different sizes, in a fixed order. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/gan_ddp.py
    sudo greyhound-trace attach <torchrun's PID>

The "real" images are each rank's own draws of soft blobs at random places
(16 x 16, one channel). --truth FILE logs each step (JSON lines: rank,
index, start_ns, dur_ns, loss (the discriminator's), loss_g, and with
--checksums `params_g` and `params_d`: checksums of this rank's generator
and discriminator parameters) for the tests and benchmarks.
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
from torch.nn.parallel import DistributedDataParallel as DDP

LATENT = 32


class Generator(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(LATENT, 2 * width * 4 * 4)
        self.net = nn.Sequential(
            nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, 2, 1), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(self.fc(z).view(-1, 2 * self.width, 4, 4))


class Discriminator(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, 2, 1), nn.BatchNorm2d(2 * width), nn.LeakyReLU(0.2),
            nn.Flatten(), nn.Linear(2 * width * 4 * 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def real_images(n: int, gen: torch.Generator) -> torch.Tensor:
    """Soft blobs at random places, in [-1, 1]."""
    ys, xs = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    centre = torch.rand(n, 2, generator=gen) * 10 + 3
    r2 = (ys - centre[:, 0, None, None]) ** 2 + (xs - centre[:, 1, None, None]) ** 2
    return (2 * torch.exp(-r2 / 8.0) - 1).unsqueeze(1)


def checksum(tensors) -> float:
    with torch.no_grad():
        return round(sum(float(t.double().sum()) for t in tensors), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="real images per step and rank")
    p.add_argument("--width", type=int, default=32, help="the models' narrowest channels")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of this rank's models with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    g, d = DDP(Generator(args.width)), DDP(Discriminator(args.width))
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    labels = torch.cat([torch.ones(args.batch), torch.zeros(args.batch)])
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            real = real_images(args.batch, gen)
            fake = g(torch.randn(args.batch, LATENT, generator=gen))
            # The discriminator: real and generated in one forward (a DDP
            # module forwarded twice before one backward would fail).
            opt_d.zero_grad()
            loss_d = bce(d(torch.cat([real, fake.detach()])), labels)
            loss_d.backward()
            opt_d.step()
            # The generator, through the discriminator without syncing it.
            opt_g.zero_grad()
            with d.no_sync():
                loss_g = bce(d(fake), torch.ones(args.batch))
                loss_g.backward()
            opt_g.step()
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss_d.item(), 6),
                       "loss_g": round(loss_g.item(), 6)}
                if args.checksums:
                    rec["params_g"] = checksum(g.parameters())
                    rec["params_d"] = checksum(d.parameters())
                log.write(json.dumps(rec) + "\n")
            if rank == 0 and (step + 1) % 500 == 0:
                print(f"step {step + 1}: loss D {loss_d.item():.4f} G {loss_g.item():.4f}",
                      flush=True)
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
