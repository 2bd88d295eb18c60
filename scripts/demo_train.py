#!/usr/bin/env python3
"""Demo training job: real PyTorch DDP on the CPU over gloo.

An MLP on synthetic regression data, with gradient accumulation over
micro-batches. It is the job that `scripts/demo`, the tests and the
benchmarks attach to, and it logs its own ground truth, one JSON line per
iteration per rank: index, start_ns, dur_ns, the number of all-reduces this
rank issued so far (counted by a DDP communication hook, one per bucket) and
the loss. Run it under torchrun:

    torchrun --nproc-per-node 4 scripts/demo_train.py --steps 200 --truth /tmp/gt.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from mitigation.distributed import Greyhound  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations to run (0: until killed)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank per step")
    p.add_argument("--mb-size", type=int, default=32, help="samples per micro-batch")
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--layers", type=int, default=4, help="MLP depth")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--go-file", help="wait for this file to exist before the first step")
    p.add_argument("--bucket-mb", type=float, default=0.25,
                   help="DDP bucket size: sets how many all-reduces a step issues")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="per-step wait for input, as a data loader would (default 0)")
    p.add_argument("--control-file",
                   help="follow greyhound's plans in this file (mitigation.control): "
                        "micro-batch counts per data-parallel rank, applied between steps")
    p.add_argument("--checkpoint",
                   help="checkpoint path: resume from it when it exists; a checkpoint_restart "
                        "plan saves it and exits with code 75 for greyhound-run to relaunch")
    p.add_argument("--save-final", help="write the final parameters here (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to one CPU of those it may use (rank modulo their "
                        "count), as trainers bind ranks to cores or GPUs")
    return p.parse_args(argv)


def build_model(hidden: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, 1))
    return nn.Sequential(*mods)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.pin:    # before the process group starts its threads, which inherit it
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ.get("RANK", 0)) % len(cpus)]})
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(build_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_mb)

    state = {"allreduces": 0}

    def counting_allreduce(st, bucket):
        # The default hook's behaviour (sum, then divide by world size), plus a
        # count of the all-reduces this rank issues: the test's ground truth.
        st["allreduces"] += 1
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))

    model.register_comm_hook(state, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed + rank)
    true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(args.seed))
    log = open(args.truth, "a", buffering=1) if args.truth else None

    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.02)

    # The global batch is world x microbatches; a plan may split it unevenly.
    total_mb = world * args.microbatches
    step = 0
    ckpt = None
    if args.checkpoint and os.path.exists(args.checkpoint):
        # Resume: same parameters, optimizer state, step and data stream. After
        # a restart without some ranks the global batch stays the same size.
        ckpt = torch.load(args.checkpoint, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, total_mb = ckpt["step"], ckpt["total_mb"]
        # The data streams go on where they stopped: the ranks kept (all
        # but greyhound-run's GREYHOUND_EXCLUDE, ranks of the last launch)
        # take, in order, the new contiguous ranks and their streams.
        gens = ckpt["generators"]
        left_out = {int(x) for x in os.environ.get("GREYHOUND_EXCLUDE", "").split(",") if x}
        kept = [r for r in range(len(gens)) if r not in left_out]
        if len(kept) == world:
            gen.set_state(gens[kept[rank]])
    if log and os.environ.get("GREYHOUND_RESTARTS"):
        # Under greyhound-run: which launch this is, and where this rank runs.
        log.write(json.dumps({"rank": rank, "launch": int(os.environ["GREYHOUND_RESTARTS"]),
                              "world": world, "cpus": sorted(os.sched_getaffinity(0)),
                              "step": step}) + "\n")
    if log and os.environ.get("GREYHOUND_LAYER_SPLIT"):
        # This demo model has no pipeline stages: it records the split a
        # pipeline trainer would build its stages from.
        log.write(json.dumps({"rank": rank, "layer_split": [
            int(x) for x in os.environ["GREYHOUND_LAYER_SPLIT"].split(",")], "step": step}) + "\n")
    # Greyhound's plans (mitigation.distributed): the same micro-batch split
    # on every rank at every step, and the loss scale that keeps the
    # gradient the global batch's; without --control-file, the even split.
    gh = Greyhound(args.control_file or "", microbatches=args.microbatches,
                   total_microbatches=total_mb, checkpoint=bool(args.checkpoint),
                   applied_seq=ckpt["seq"] if ckpt else 0)
    exit_code = 0
    try:
        while args.steps == 0 or step < args.steps:
            if args.idle_ms:
                time.sleep(args.idle_ms / 1000)
            s = gh.step()
            if s.restart:       # checkpoint_restart, or a pipeline re-split (at restart)
                save_checkpoint(args.checkpoint, model, opt, step, total_mb, gen,
                                rank, world, s.restart.seq)
                exit_code = gh.restart(args.checkpoint)
                break
            my_mb, scale = s.microbatches, s.loss_scale
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            total, data = 0.0, None
            for mb in range(my_mb):
                x = torch.randn(args.mb_size, 64, generator=gen)
                if data is None:
                    data = float(x.sum())     # where this rank's data stream stands
                y = x @ true_w
                last = mb == my_mb - 1
                ctx = model.no_sync() if not last else contextlib.nullcontext()
                with ctx:
                    loss = nn.functional.mse_loss(model(x), y) * scale
                    loss.backward()
                total += loss.item()
            opt.step()
            t1 = time.time_ns()
            if log:
                log.write(json.dumps({"rank": rank, "index": step, "start_ns": t0,
                                      "dur_ns": t1 - t0, "allreduces": state["allreduces"],
                                      "microbatches": my_mb, "loss": total,
                                      "data": data}) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    finally:
        summary = {"rank": rank, "final": True, "steps": step,
                   "allreduces": state["allreduces"], "exit_code": exit_code}
        if log:
            log.write(json.dumps(summary) + "\n")   # one append: atomic across ranks
            log.close()
    print(json.dumps(summary), flush=True)
    if args.save_final and rank == 0 and exit_code == 0:
        torch.save(model.module.state_dict(), args.save_final)
    # Drop every reference to the process group before the interpreter shuts
    # down, so ~ProcessGroupGloo joins its worker threads now: a worker still
    # releasing the comm hook's Python callback during finalization aborts
    # the process ("terminate called without an active exception").
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return exit_code


def save_checkpoint(path, model, opt, step, total_mb, gen, rank, world, seq) -> None:
    """Every rank's data-stream state is gathered; rank 0 writes one file
    atomically (temporary file, then rename)."""
    states = [None] * world
    dist.all_gather_object(states, gen.get_state())
    if rank == 0:
        tmp = f"{path}.tmp"
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "step": step, "total_mb": total_mb, "generators": states, "seq": seq}, tmp)
        os.replace(tmp, path)
    dist.barrier()


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization: even after
    # destroy_process_group, a gloo worker thread can still be torn down
    # with it and abort a finished rank ("terminate called without an active
    # exception", SIGABRT; pytorch/pytorch#179291 discusses it). Every
    # output is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
