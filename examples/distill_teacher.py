#!/usr/bin/env python3
"""Knowledge distillation with a teacher rank, over gloo on the CPU: rank 0
holds a large frozen teacher and does no training; ranks 1..N-1 are the
students, a small model trained data-parallel (DDP on a process group of
their own). Each step the teacher draws every student's batch (the same
generator the student holds), runs its forward on all of them and scatters
each student its soft targets (`dist.scatter` from rank 0 over the whole
job); each student then trains on KL(teacher || student) at a temperature
plus the hard labels, its gradients all-reduced among the students only.
The ranks do different work: one forward of N-1 batches through the big
model against a forward and backward of one batch through the small one. A
job shape Greyhound's rules were not written around (its corpus records it
as held out):

    torchrun --nproc-per-node 3 examples/distill_teacher.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
`role`, and the student's loss; null on the teacher), with --checksums
`targets`: the sum of the soft targets the rank sent (teacher) or received
(student), and on students `params`: a checksum of the parameters after
the step (the students agree).
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

FEATURES, CLASSES = 32, 10


def mlp(width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers, d = [], FEATURES
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, CLASSES))


def teacher(width: int, seed: int) -> nn.Module:
    net = mlp(width, 4, seed + 1)
    net.requires_grad_(False)
    return net.eval()


def student(width: int, seed: int) -> nn.Module:
    return mlp(width, 2, seed + 2)


def batch(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs whose label is the largest of their first CLASSES features."""
    x = torch.randn(size, FEATURES, generator=gen)
    return x, x[:, :CLASSES].argmax(dim=1)


def data(seed: int, student_rank: int) -> torch.Generator:
    """A student's data stream: the student and the teacher each hold one."""
    return torch.Generator().manual_seed(seed + 1000 * student_rank)


def distill_loss(logits: torch.Tensor, soft: torch.Tensor, y: torch.Tensor,
                 temperature: float, alpha: float) -> torch.Tensor:
    """Hinton et al.'s loss: KL to the teacher's softened distribution
    (scaled by T^2) and cross-entropy to the labels, weighted alpha : 1 - alpha."""
    kl = F.kl_div(F.log_softmax(logits / temperature, dim=1),
                  F.log_softmax(soft / temperature, dim=1), log_target=True,
                  reduction="batchmean") * temperature ** 2
    return alpha * kl + (1 - alpha) * F.cross_entropy(logits, y)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--batch", type=int, default=512, help="samples per student per step")
    p.add_argument("--teacher-width", type=int, default=512)
    p.add_argument("--student-width", type=int, default=512)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.7, help="weight of the distillation term")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log checksums of the soft targets and the student's parameters")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("distill_teacher: needs at least 2 ranks (a teacher and a student)",
              file=sys.stderr)
        return 2
    students = dist.new_group(list(range(1, world)))     # every rank takes part in new_group
    if rank == 0:
        net = teacher(args.teacher_width, args.seed)
        streams = [data(args.seed, s) for s in range(1, world)]
    else:
        net = DDP(student(args.student_width, args.seed), process_group=students)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
        stream = data(args.seed, rank)
    soft = torch.empty(args.batch, CLASSES)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            loss = None
            if rank == 0:
                with torch.no_grad():
                    sent = [net(batch(g, args.batch)[0]) for g in streams]
                dist.scatter(soft, [torch.zeros_like(soft)] + sent, src=0)
                total = float(sum(t.sum() for t in sent)) if args.checksums else None
            else:
                x, y = batch(stream, args.batch)
                dist.scatter(soft, None, src=0)
                logits = net(x)
                out = distill_loss(logits, soft, y, args.temperature, args.alpha)
                opt.zero_grad(set_to_none=True)
                out.backward()
                opt.step()
                loss = round(out.item(), 6)
                total = float(soft.sum()) if args.checksums else None
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": loss,
                       "role": "teacher" if rank == 0 else "student"}
                if args.checksums:
                    row["targets"] = total
                    if rank:
                        row["params"] = float(sum(q.detach().double().sum()
                                                  for q in net.parameters()))
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
