#!/usr/bin/env python3
"""A CNN under DDP over gloo on the CPU whose batch norm is synchronised
across the ranks, as detection and segmentation models train (small
per-rank batches): every batch-norm layer gathers each rank's sums in the
forward (an all-gather per layer, as PyTorch's SyncBatchNorm does) and
all-reduces its gradient sums in the backward, in between DDP's bucket
all-reduces. So the job's collectives sit inside its compute, in both
passes. PyTorch's own `nn.SyncBatchNorm` runs on GPUs only; this is its
algorithm (statistics over the global batch, the same running averages on
every rank) written with torch.distributed, the way CPU jobs write it. A
job shape Greyhound's rules were not written around (its corpus records it
as held out):

    torchrun --nproc-per-node 3 examples/syncbn_cnn.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns, dur_ns,
loss), with --checksums `params` (this rank's parameters) and `stats` (its
batch norms' running averages: equal on every rank, as they are synced).
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
from torch.nn.utils import parameters_to_vector


class _SyncNorm(torch.autograd.Function):
    """Batch norm over every rank's batch: the forward all-gathers each
    rank's (sum, sum of squares, count) per channel, the backward
    all-reduces (sum of dy, sum of dy * x_hat)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        c = x.size(1)
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                           torch.tensor([x.numel() / c], dtype=x.dtype)])
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        total = torch.stack(parts).sum(0)
        count = total[-1]
        mean = total[:c] / count
        var = (total[c:2 * c] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.view(1, c, 1, 1)) * invstd.view(1, c, 1, 1)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count = count
        ctx.mark_non_differentiable(mean, var)
        return xhat * weight.view(1, c, 1, 1) + bias.view(1, c, 1, 1), mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xhat, weight, invstd = ctx.saved_tensors
        c = dy.size(1)
        sums = torch.cat([dy.sum((0, 2, 3)), (dy * xhat).sum((0, 2, 3))])
        grad_weight, grad_bias = sums[c:].clone(), sums[:c].clone()   # local: DDP averages
        dist.all_reduce(sums)
        mean_dy = (sums[:c] / ctx.count).view(1, c, 1, 1)
        mean_dy_xhat = (sums[c:] / ctx.count).view(1, c, 1, 1)
        dx = (weight * invstd).view(1, c, 1, 1) * (dy - mean_dy - xhat * mean_dy_xhat)
        return dx, grad_weight, grad_bias, None


class SyncNorm2d(nn.BatchNorm2d):
    def forward(self, x):
        if not self.training:
            return super().forward(x)
        y, mean, var = _SyncNorm.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():
            n = x.numel() / x.size(1) * dist.get_world_size()
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / max(n - 1, 1), self.momentum)
            self.num_batches_tracked += 1
        return y


def cnn(width: int, blocks: int) -> nn.Module:
    layers, cin = [], 3
    for i in range(blocks):
        cout = width * 2 ** min(i, 2)
        layers += [nn.Conv2d(cin, cout, 3, padding=1), SyncNorm2d(cout), nn.ReLU()]
        if i % 2:
            layers.append(nn.MaxPool2d(2))
        cin = cout
    side = 32 // 2 ** (blocks // 2)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * side * side, 10))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=16, help="32x32 images per rank per iteration")
    p.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    p.add_argument("--blocks", type=int, default=4,
                   help="convolution + synced batch norm blocks")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of the parameters and the running statistics")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    net = cnn(args.width, args.blocks)
    # The running statistics are synced already: no buffer broadcast.
    model = DDP(net, forward_sync_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    # Each rank's images are its own, and lean to its own brightness: a
    # local batch norm's statistics would differ from rank to rank.
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, 3, 32, 32, generator=gen) + 0.5 * rank
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(loss.item(), 6)}
                if args.checksums:
                    row["params"] = float(parameters_to_vector(net.parameters())
                                          .detach().double().sum())
                    row["stats"] = float(sum(m.running_mean.double().sum() +
                                             m.running_var.double().sum()
                                             for m in net.modules()
                                             if isinstance(m, SyncNorm2d)))
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
