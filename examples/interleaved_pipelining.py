#!/usr/bin/env python3
"""Interleaved pipeline parallelism (Megatron-LM's virtual stages; Narayanan
et al., 2021) with PyTorch's own `torch.distributed.pipelining`, as
torchtitan runs it, over gloo on the CPU: a small transformer language
model cut into `--virtual` stages per rank, rank r holding stages r,
r + world, ... (so the last rank's first stage hands its activations back
to rank 0's second: the micro-batches go round the ranks `--virtual`
times), and a step run by `ScheduleInterleaved1F1B`: a warm-up of
forwards, then one forward and one backward in turn, earlier micro-batches
first, every activation and gradient passed by the library's own sends and
receives. After the schedule the ranks clip by the model's global gradient
norm (one all-reduce of their squared norms) and step AdamW. No data
parallelism: every rank is a pipeline rank. The model, the data and the
one-process reference are `gpipe_pipelining.py`'s. A job shape Greyhound's
rules were not written around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/interleaved_pipelining.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each step (JSON lines: rank, index, start_ns, dur_ns,
stages (this rank's), layers (over its stages), loss (the rank holding the
last stage: the mean over the micro-batches; null elsewhere), grad_norm,
and with --checksums `params`: a checksum of this rank's parameters) for
the tests and benchmarks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from gpipe_pipelining import batch, finish_step, loss_fn, optimizer, parts, step_record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="steps (0: until killed)")
    p.add_argument("--virtual", type=int, default=2, help="stages per rank")
    p.add_argument("--microbatches", type=int, default=0,
                   help="micro-batches per step (0: twice the ranks)")
    p.add_argument("--per-microbatch", type=int, default=3, help="sequences per micro-batch")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=0,
                   help="transformer layers over all stages (0: one a stage)")
    p.add_argument("--truth", help="append per-step ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's parameters with each step (a test's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = world * args.virtual
    microbatches = args.microbatches or 2 * world
    size = microbatches * args.per_microbatch
    mine = [rank + k * world for k in range(args.virtual)]
    whole = parts(args.dim, args.depth or n_stages, args.context, n_stages, args.seed)
    stages = [PipelineStage(whole[i], i, n_stages, torch.device("cpu")) for i in mine]
    schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    params = [q for i in mine for q in whole[i].parameters()]
    opt = optimizer(params)
    first, last = 0 in mine, n_stages - 1 in mine
    if rank == 0:
        print(f"{world} ranks, {n_stages} stages ({args.virtual} a rank), {microbatches} "
              f"micro-batches of {args.per_microbatch}, interleaved 1F1B", flush=True)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            x, y = batch(args.seed, step, size, args.context)
            losses: list[torch.Tensor] = []
            if first:
                schedule.step(x, target=y if last else None, losses=losses if last else None)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            norm, loss = finish_step(params, opt, losses, last)
            if log:
                log.write(step_record(rank, step, t0, loss, norm, params, args.checksums,
                                      stages=mine,
                                      layers=sum(len(whole[i].layers) for i in mine)))
            if last and (step + 1) % 50 == 0:
                print(f"step {step + 1}: loss {loss:.4f}", flush=True)
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
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(code)
