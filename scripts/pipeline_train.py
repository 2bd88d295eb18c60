#!/usr/bin/env python3
"""Pipeline-parallel training job over gloo on the CPU: a GPipe schedule
(`gpipe`: every micro-batch forward, then every one backward, activations
and gradients by dist.send / dist.recv), `--pp` stages x (world / pp)
data-parallel replicas, a model of `--blocks` identical blocks split over
the stages by `layer_split`. (torch.distributed.pipelining's ScheduleGPipe
deadlocks over gloo on this torch, 2.13: a stage waits for its forward
sends while the next one's backward sends wait for it; so the schedule is
written out here, as pipeline trainers of the Megatron kind do.)

It follows Greyhound's plans (mitigation.distributed): it announces its
stage and layer split, and on a `reconfigure_pipeline` plan it saves a
checkpoint and exits 75; greyhound-run relaunches it with the plan's split
(GREYHOUND_LAYER_SPLIT), and every block's parameters move to the stage
that now holds it. The data of a step depends only on (seed, step,
replica), and the optimizer (plain SGD) has no state, so a re-split run's
losses continue as an uninterrupted run's. Logs its own ground truth, one
JSON line per iteration per rank (index, start_ns, dur_ns, stage,
layer_split, loss on the last stage).

    torchrun --nproc-per-node 4 scripts/pipeline_train.py --pp 2 --steps 50 --truth /tmp/gt.jsonl
    greyhound-run --control-file /tmp/ctl.json --nproc 4 -- torchrun --nproc-per-node {nproc} \\
        scripts/pipeline_train.py --control-file /tmp/ctl.json --checkpoint /tmp/pp-ckpt
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mitigation.control import even_split  # noqa: E402
from mitigation.distributed import Greyhound  # noqa: E402

IN = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--blocks", type=int, default=8, help="identical blocks in the model")
    p.add_argument("--hidden", type=int, default=256, help="block width")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    p.add_argument("--mb-size", type=int, default=32, help="samples per micro-batch")
    p.add_argument("--idle-ms", type=float, default=0.0, help="per-step wait for input")
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--control-file", help="follow greyhound's plans in this file")
    p.add_argument("--checkpoint", help="checkpoint directory: resume from it when it holds "
                                        "one; a re-split or restart plan saves one and exits 75")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to one CPU of those it may use (rank modulo their "
                        "count): on 2 CPUs, stage 0 on one and stage 1 on the other")
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def full_model(args) -> dict[str, nn.Module]:
    """Every part of the model, built the same on every rank (one seed)."""
    torch.manual_seed(args.seed)
    parts = {"inp": nn.Linear(IN, args.hidden)}
    for i in range(args.blocks):
        parts[f"block{i}"] = Block(args.hidden)
    parts["head"] = nn.Linear(args.hidden, 1)
    return parts


def stage_parts(args, split: list[int], stage: int) -> list[str]:
    lo = sum(split[:stage])
    names = [f"block{i}" for i in range(lo, lo + split[stage])]
    if stage == 0:
        names = ["inp", *names]
    if stage == len(split) - 1:
        names = [*names, "head"]
    return names


def load_parts(parts: dict[str, nn.Module], ckpt_dir: str) -> dict:
    """Each part's parameters from the stage that saved it, whichever stage
    holds it now; returns the checkpoint's metadata."""
    meta = json.load(open(os.path.join(ckpt_dir, "meta.json")))
    for f in sorted(glob.glob(os.path.join(ckpt_dir, "stage*.pt"))):
        for name, state in torch.load(f, weights_only=True).items():
            parts[name].load_state_dict(state)
    return meta


def pp_ranks(replica: int, pp: int) -> list[int]:
    return [replica * pp + s for s in range(pp)]


def gpipe(module: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, hidden: int,
          prev: int | None, nxt: int | None) -> list[float]:
    """One GPipe step of this stage: every micro-batch forward (activations
    received from the previous stage, sent to the next), then every one
    backward (gradients the other way). Gradients accumulate, scaled by
    1/n: the mean over the step's micro-batches. Returns the last stage's
    micro-batch losses."""
    xs, ys = x.chunk(n), y.chunk(n)
    inputs, outputs, losses = [], [], []
    for i in range(n):
        if prev is None:
            inp = xs[i]
        else:
            inp = torch.empty(xs[i].shape[0], hidden)
            dist.recv(inp, prev)
            inp.requires_grad_(True)
        out = module(inp)
        if nxt is not None:
            dist.send(out.detach(), nxt)
        else:
            out = nn.functional.mse_loss(out, ys[i])
            losses.append(float(out.detach()))
        inputs.append(inp)
        outputs.append(out)
    for i in range(n):
        if nxt is None:
            (outputs[i] / n).backward()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, nxt)
            outputs[i].backward(grad)
        if prev is not None:
            dist.send(inputs[i].grad, prev)
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.pin:    # before the process group starts its threads, which inherit it
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ.get("RANK", 0)) % len(cpus)]})
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = args.pp
    if world % pp:
        raise SystemExit(f"world {world} is not a multiple of --pp {pp}")
    dp = world // pp
    stage, replica = rank % pp, rank // pp
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    dp_group = dp_groups[stage]
    split_env = os.environ.get("GREYHOUND_LAYER_SPLIT")
    split = [int(x) for x in split_env.split(",")] if split_env else even_split(args.blocks, pp)
    if len(split) != pp or sum(split) != args.blocks or min(split) < 1:
        raise SystemExit(f"layer split {split} does not fit {args.blocks} blocks on {pp} stages")

    parts = full_model(args)
    step, applied = 0, 0
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "meta.json")):
        meta = load_parts(parts, args.checkpoint)
        step, applied = meta["step"], meta["seq"]
    names = stage_parts(args, split, stage)
    module = nn.Sequential(*(parts[n] for n in names))
    del parts
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    last = stage == pp - 1

    def loss_fn(out, target):
        return nn.functional.mse_loss(out, target)

    prev = pp_ranks(replica, pp)[stage - 1] if stage > 0 else None
    nxt = pp_ranks(replica, pp)[stage + 1] if not last else None
    true_w = torch.randn(IN, 1, generator=torch.Generator().manual_seed(args.seed))
    gh = Greyhound(args.control_file or "", microbatches=args.microbatches,
                   checkpoint=bool(args.checkpoint), stage=stage, layer_split=split,
                   applied_seq=applied, rebalance=False)
    log = open(args.truth, "a", buffering=1) if args.truth else None
    exit_code = 0
    try:
        while args.steps == 0 or step < args.steps:
            if args.idle_ms:
                time.sleep(args.idle_ms / 1000)
            s = gh.step()
            if s.restart:
                save(args.checkpoint, module, names, stage, replica, step, s.restart.seq,
                     dp_group)
                exit_code = gh.restart(args.checkpoint)
                break
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + replica)
            x = torch.randn(args.microbatches * args.mb_size, IN, generator=g)
            t0 = time.time_ns()
            opt.zero_grad(set_to_none=True)
            losses = gpipe(module, x, x @ true_w, args.microbatches, args.hidden, prev, nxt)
            for p in params:              # data parallel: the replicas' mean gradient
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp)
            opt.step()
            t1 = time.time_ns()
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0, "dur_ns": t1 - t0,
                       "stage": stage, "layer_split": split}
                if last:
                    rec["loss"] = sum(losses) / len(losses)
                log.write(json.dumps(rec) + "\n")
            step += 1
    except KeyboardInterrupt:
        pass
    finally:
        if log:
            log.write(json.dumps({"rank": rank, "final": True, "steps": step,
                                  "exit_code": exit_code}) + "\n")
            log.close()
    del module, opt
    gc.collect()
    dist.destroy_process_group()
    return exit_code


def save(ckpt_dir: str, module: nn.Module, names: list[str], stage: int, replica: int,
         step: int, seq: int, dp_group) -> None:
    """Replica 0 of each stage saves its parts (the replicas hold the same
    parameters); stage 0's writes the step last. Atomic per file."""
    if replica == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        states = {n: m.state_dict() for n, m in zip(names, module)}
        tmp = os.path.join(ckpt_dir, f".stage{stage}.pt.tmp")
        torch.save(states, tmp)
        os.replace(tmp, os.path.join(ckpt_dir, f"stage{stage}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(ckpt_dir, ".meta.json.tmp")
        with open(tmp, "w") as fh:
            json.dump({"step": step, "seq": seq}, fh)
        os.replace(tmp, os.path.join(ckpt_dir, "meta.json"))
    dist.barrier()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)           # gloo threads and interpreter finalization: see demo_train.py
