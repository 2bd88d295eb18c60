"""A DDP job whose ranks read the plans from different files: the copies a
per-node agent writes on each node of a multi-node job (one rank per "node"
here), which the test updates at different moments, so the ranks read a plan
at different steps. Logs, per step and rank: the micro-batch count, the
plan applied, and a checksum of the parameters.

    torchrun --nproc-per-node 3 tests/targets/agree.py CTL_TEMPLATE LOG
(CTL_TEMPLATE holds {rank}.)"""
import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from mitigation.distributed import Greyhound  # noqa: E402


def main(template: str, log_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    gh = Greyhound(template.format(rank=rank), microbatches=4)
    stop = template.format(rank="stop")
    with open(log_path, "a", buffering=1) as log:
        for step in range(100000):
            s = gh.step()
            opt.zero_grad(set_to_none=True)
            for i in range(s.microbatches):
                x = torch.randn(4, 8, generator=gen)
                ctx = model.no_sync() if i < s.microbatches - 1 else contextlib.nullcontext()
                with ctx:
                    (model(x).pow(2).mean() * s.loss_scale).backward()
            opt.step()
            log.write(json.dumps({"rank": rank, "step": step, "microbatches": s.microbatches,
                                  "seq": gh.applied_seq, "loss_scale": s.loss_scale,
                                  "params": sum(float(t.sum()) for t in model.parameters())})
                      + "\n")
            flag = torch.tensor([int(os.path.exists(stop))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)     # stop together
            if flag.item():
                break
            time.sleep(0.01)
    del model, opt
    gc.collect()
    dist.destroy_process_group()



if __name__ == "__main__":
    main(*sys.argv[1:])
