#!/usr/bin/env python3
"""A Hugging Face Accelerate loop that follows Greyhound's plans.

Gradient accumulation becomes per rank: a rebalance plan gives each rank its
own number of micro-batches per optimizer step (a slow rank fewer), and the
global batch stays the same. Accelerate's own `gradient_accumulation_steps`
is one number for every rank, so the loop accumulates itself: `no_sync` on
all but the rank's last micro-batch, and the loss scaled by Greyhound's
`loss_scale` (Accelerate divides by its accumulation steps, 1 here).

    accelerate launch --cpu --num_processes 2 examples/accelerate_loop.py --control-file /tmp/ctl.json
    torchrun --nproc-per-node 2 examples/accelerate_loop.py --control-file /tmp/ctl.json
    sudo greyhound-trace attach <launcher PID> --control-file /tmp/ctl.json --mitigate
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mitigation.distributed import Greyhound  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control-file", help="Greyhound's control file (default: "
                   "$GREYHOUND_CONTROL_FILE; none: the even split)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: until killed)")
    p.add_argument("--accumulation", type=int, default=4,
                   help="gradient accumulation steps per rank, as configured")
    p.add_argument("--step-log", help="append one JSON line per step per rank here")
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)          # gradient_accumulation_steps=1: see above
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    gen = torch.Generator().manual_seed(accelerator.process_index)
    log = open(args.step_log, "a", buffering=1) if args.step_log else None

    gh = Greyhound(args.control_file, microbatches=args.accumulation)      # GREYHOUND
    step = 0
    while args.steps == 0 or step < args.steps:
        s = gh.step()                                                       # GREYHOUND
        for i in range(s.microbatches):
            x = torch.randn(16, 32, generator=gen)
            last = i == s.microbatches - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                accelerator.backward(loss * s.loss_scale)                   # GREYHOUND
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log:
            log.write(json.dumps({"rank": accelerator.process_index, "step": step,
                                  "microbatches": s.microbatches,
                                  "seq": gh.applied_seq,
                                  "params": sum(float(t.sum()) for t in model.parameters())})
                      + "\n")
        step += 1
    del model, opt               # before the process group: see plain_pytorch.py
    gc.collect()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
