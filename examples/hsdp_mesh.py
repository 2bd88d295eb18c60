#!/usr/bin/env python3
"""Hybrid-sharded data parallelism (HSDP) over gloo on the CPU: FSDP2's
`fully_shard` on a 2-D device mesh, parameters sharded within each
"shard" group and replicated across the "replicate" groups, as large jobs
shard within a node and replicate across nodes. With 4 ranks the mesh is
2 x 2: ranks (0, 1) and (2, 3) each hold one copy of the model between
them, so every iteration all-gathers each block's parameters within the
pair (forward and backward), reduce-scatters its gradients within the
pair, then all-reduces the gradient shards across the pairs: every rank
is in two communicators. A job shape Greyhound's rules were not written
around (its corpus records it as held out):

    torchrun --nproc-per-node 4 examples/hsdp_mesh.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss, `replica` and `shard`: this rank's coordinates in the mesh,
and with --checksums `params`: a checksum of this rank's parameter shards)
for the tests and benchmarks.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=192, help="the blocks' input and output width")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--shard", type=int, default=2,
                   help="ranks per shard group (the world size must be a multiple)")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameter shards each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.shard:
        sys.exit(f"hsdp_mesh: the world size ({world}) is not a multiple of --shard "
                 f"({args.shard})")
    mesh = init_device_mesh("cpu", (world // args.shard, args.shard),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)
    w = args.width
    blocks = [nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.GELU(),
                            nn.Linear(2 * w, w)) for _ in range(args.blocks)]
    model = nn.Sequential(*blocks)
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    coords = {"replica": mesh.get_local_rank("replicate"), "shard": mesh.get_local_rank("shard")}
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            x = torch.randn(args.batch, w, generator=gen)
            loss = (model(x) - x.flip(-1)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": time.time_ns() - t0,
                   "loss": round(loss.item(), 6), **coords}
            if log and args.checksums:
                with torch.no_grad():
                    rec["params"] = round(sum(float(q.to_local().double().sum())
                                              for q in model.parameters()), 9)
            if log:
                log.write(json.dumps(rec) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)     # no process-group teardown: FSDP's can abort at exit on gloo
