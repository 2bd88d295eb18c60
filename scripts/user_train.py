#!/usr/bin/env python3
"""A training job written the way users write them, not for Greyhound:
PyTorch DDP over gloo on the CPU, a DataLoader with worker processes over a
synthetic image dataset, a small convolutional network, DDP's default
buckets and no control file. The scenario corpus (scripts/record_scenario)
records it beside scripts/demo_train.py, so that the rules are tried on a
job they were not written around.

It logs its own per-iteration truth when asked (--truth, JSON lines: rank,
index, start_ns, dur_ns), as demo_train.py does. Run it under torchrun:

    torchrun --nproc-per-node 3 scripts/user_train.py --steps 500 --workers 2
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Shapes(Dataset):
    """Synthetic 3x32x32 images whose class is the brightest quadrant."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.rand(3, 32, 32, generator=g) * 0.5
        label = int(torch.randint(0, 4, (1,), generator=g))
        r, c = divmod(label, 2)
        x[:, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16] += 0.5
        return x, label


def net(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 4))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(net(args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Shapes(1 << 20, args.seed)
    sampler = DistributedSampler(data, world, rank, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, num_workers=args.workers,
                        sampler=sampler, persistent_workers=args.workers > 0)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0

    def batches():
        # Epoch after epoch (one is about 8 minutes at 3 ranks): --steps 0
        # trains until killed, as a benchmark's long job must.
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    try:
        for x, y in batches():
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": time.time_ns() - t0,
                                      "loss": round(loss.item(), 5)}) + "\n")
            step += 1
            if args.steps and step >= args.steps:
                break
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
    os._exit(code)     # as demo_train.py: no gloo thread torn down in finalization
