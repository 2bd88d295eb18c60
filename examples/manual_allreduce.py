#!/usr/bin/env python3
"""Data parallelism written by hand, as PyTorch's tutorial "Writing
Distributed Applications with PyTorch" teaches it and much older code
still does: no DDP wrapper, a small convolutional net, each rank on its
own partition of the data, and after every backward `average_gradients`
all-reduces each parameter's gradient on its own (one collective per
parameter tensor, 8 a step, none overlapping the backward) and divides by
the world size; SGD with momentum, and the epoch's mean loss all-reduced
at each epoch's end. A job shape Greyhound's rules were not written around
(its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/manual_allreduce.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns)
with its loss, and with --checksums `params`: a checksum of this rank's
parameters (the replicas agree).
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


class Net(nn.Module):
    """The tutorial's network (MNIST-sized)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def average_gradients(model: nn.Module) -> None:
    """The tutorial's gradient averaging: one all-reduce per parameter."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=128, help="images per rank per step")
    p.add_argument("--epoch", type=int, default=50, help="steps per epoch (its partition)")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the parameters each step")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    # This rank's partition: synthetic digits, each class a fixed blob.
    protos = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step, epoch_loss, last_epoch = 0, 0.0, None
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            x = protos[y] + 0.8 * torch.randn(args.batch, 1, 28, 28, generator=gen)
            opt.zero_grad()
            loss = F.nll_loss(model(x), y)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            opt.step()
            if step % args.epoch == args.epoch - 1:
                mean = torch.tensor([epoch_loss / args.epoch])
                dist.all_reduce(mean)                   # the epoch's loss, every rank's
                last_epoch, epoch_loss = round(mean.item() / world, 6), 0.0
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6),
                       "epoch_loss": last_epoch}
                if args.checksums:
                    row["params"] = float(sum(q.double().sum() for q in model.parameters()))
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
