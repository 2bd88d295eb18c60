#!/usr/bin/env python3
"""A plain PyTorch DDP loop that follows Greyhound's plans.

Run it (CPU, gloo) and attach Greyhound to it:

    torchrun --nproc-per-node 2 examples/plain_pytorch.py --control-file /tmp/ctl.json
    sudo greyhound-trace attach <torchrun's PID> --control-file /tmp/ctl.json --mitigate

The three lines marked GREYHOUND are all a loop needs: the same micro-batch
split on every rank at every step, and a loss scale that keeps the
all-reduced gradient the global batch's whatever the split.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mitigation.distributed import Greyhound  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control-file", help="Greyhound's control file (default: "
                   "$GREYHOUND_CONTROL_FILE; none: the even split)")
    p.add_argument("--steps", type=int, default=0, help="steps to run (0: until killed)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank")
    p.add_argument("--step-log", help="append one JSON line per step per rank here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    log = open(args.step_log, "a", buffering=1) if args.step_log else None

    gh = Greyhound(args.control_file, microbatches=args.microbatches)      # GREYHOUND
    step = 0
    while args.steps == 0 or step < args.steps:
        s = gh.step()                                                       # GREYHOUND
        opt.zero_grad(set_to_none=True)
        for i in range(s.microbatches):
            x = torch.randn(16, 32, generator=gen)
            with model.no_sync() if i < s.microbatches - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                (loss * s.loss_scale).backward()                            # GREYHOUND
        opt.step()
        if log:
            log.write(json.dumps({"rank": dist.get_rank(), "step": step,
                                  "microbatches": s.microbatches,
                                  "seq": gh.applied_seq,
                                  "params": sum(float(t.sum()) for t in model.parameters())})
                      + "\n")
        step += 1
    # Drop the model (DDP's reducer holds the process group) before the group:
    # then ~ProcessGroupGloo joins its threads now, not during interpreter
    # shutdown, where a gloo thread torn down late can abort a finished rank.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
