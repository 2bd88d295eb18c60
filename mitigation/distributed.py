"""Greyhound's plans in a torch.distributed training loop, in three lines.

    from mitigation.distributed import Greyhound

    gh = Greyhound(args.control_file, microbatches=4, checkpoint=True)  # after init_process_group
    for step in ...:
        s = gh.step()                                       # the same plan on every rank
        if s.restart: save_checkpoint(path); sys.exit(gh.restart(path))
        for i in range(s.microbatches): ...; (loss * s.loss_scale).backward()

``step()`` is the agreement every trainer needs: ranks read the control file
at different times (a node's copy can lag, a rank can be a step behind), so a
plan is applied only once every rank of the group has read it, and then by
all of them before the same step. It costs one all-reduce of two integers per
step on the job's own process group; with no control file it does nothing at
all (no collective).

- ``s.microbatches``: this rank's micro-batch count for this step.
- ``s.loss_scale``: multiply each micro-batch's loss by it. DDP averages
  gradients over the ranks; with an uneven split that average is the global
  batch's gradient only if each micro-batch's loss is scaled by
  world / total (``mitigation.control.loss_scale``), the same on every rank.
- ``s.plan``: the plan applied at this step (None on most steps), acked to
  the tool once applied.
- ``s.restart``: a ``checkpoint_restart`` or ``reconfigure_pipeline`` plan
  the trainer announced it can follow (``checkpoint=True``): save a
  checkpoint, then exit with ``gh.restart(path)`` (75), which rank 0 turns
  into the restart request ``greyhound-run`` relaunches the job on.

The plans themselves are ``mitigation.control``'s; this module only adds the
agreement, so it needs torch where ``control`` needs only the standard
library.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .control import RESTART_EXIT_CODE, ControlFile, Plan, even_split, loss_scale

RESTART_STRATEGIES = ("checkpoint_restart", "reconfigure_pipeline")


@dataclass(frozen=True)
class Step:
    microbatches: int
    loss_scale: float
    plan: Plan | None = None          # applied at this step
    restart: Plan | None = None       # to follow: checkpoint, then gh.restart(path)


def where_this_runs() -> dict:
    """This rank's host, CPUs and GPU, announced so that a restart plan can
    name where a left-out rank ran (greyhound-run avoids it)."""
    import socket
    where: dict = {"host": socket.gethostname(), "cpus": sorted(os.sched_getaffinity(0))}
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            where["gpu"] = f"GPU-{props.uuid}"          # NVML's and DCGM's spelling
    except (ImportError, RuntimeError, AttributeError):
        pass
    return where


class Greyhound:
    """The trainer's side of the control file for torch.distributed jobs.

    `control_file`: the path `greyhound-trace attach --control-file` writes
    (None: $GREYHOUND_CONTROL_FILE; "" or neither: every step is the even
    split and nothing is read). `microbatches`: this rank's count per step as the
    job was configured; `total_microbatches`: the global count (default
    microbatches x the group's size; keep it across a restart that left
    ranks out, and the global batch stays the same). `group`: the
    data-parallel process group (default: the whole world); `checkpoint`:
    the trainer saves and resumes, so the tool may propose restarts;
    `stage`/`layer_split`: a pipeline's, announced for re-splits;
    `rebalance=False`: a trainer whose micro-batches are not to be moved
    between ranks (a pipeline's schedule): it does not announce its count,
    so the policy plans restarts and re-splits only."""

    def __init__(self, control_file: str | os.PathLike | None = None, *, microbatches: int,
                 total_microbatches: int | None = None, group=None, checkpoint: bool = False,
                 stage: int | None = None, layer_split: list[int] | None = None,
                 applied_seq: int = 0, rebalance: bool = True):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("Greyhound(...) needs torch.distributed initialised first "
                               "(dist.init_process_group)")
        self._dist, self.group = dist, group
        self.rank = dist.get_rank()
        self.dp_rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if microbatches < 1:
            raise ValueError("microbatches must be at least 1")
        self.total = total_microbatches if total_microbatches is not None \
            else microbatches * self.world
        if self.total < self.world:
            raise ValueError(f"{self.total} micro-batches cannot give each of "
                             f"{self.world} ranks one")
        self.microbatches = even_split(self.total, self.world)[self.dp_rank]
        self.checkpoint, self.rebalance = checkpoint, rebalance
        self.applied_seq = applied_seq      # resumed from a checkpoint: plans up to it are done
        self._seen: dict[int, Plan] = {}
        self._pending: Plan | None = None
        path = control_file if control_file is not None \
            else os.environ.get("GREYHOUND_CONTROL_FILE")
        self.ctl = ControlFile(path, rank=self.rank, dp_rank=self.dp_rank) if path else None
        if self.ctl is not None:
            state = {"world": self.world, "checkpoint": bool(checkpoint), **where_this_runs()}
            if rebalance:
                state["microbatches"] = self.microbatches
            if stage is not None:
                state["stage"] = stage
                state["pp_microbatches"] = microbatches   # the schedule's, for its bubble
            if layer_split is not None:
                state["layer_split"] = list(layer_split)
            self.ctl.announce(**state)
        self._tensor = None

    @property
    def loss_scale(self) -> float:
        return loss_scale(self.world, self.total)

    def step(self) -> Step:
        """Call once per step, on every rank of the group, before its
        micro-batches."""
        if self.ctl is None:
            return Step(self.microbatches, self.loss_scale)
        plan = self.ctl.poll()                  # one stat() when nothing changed
        if plan is not None:
            self._seen = {s: p for s, p in self._seen.items() if s > self.applied_seq}
            self._seen[plan.seq] = plan
        agreed = self._agree(max(self._seen, default=0))
        if agreed is None or agreed.seq <= self.applied_seq:
            return Step(self.microbatches, self.loss_scale)
        self.applied_seq = agreed.seq
        if agreed.strategy in RESTART_STRATEGIES and self.checkpoint:
            self._pending = agreed
            return Step(self.microbatches, self.loss_scale, restart=agreed)
        mb = agreed.microbatches
        if self.rebalance and mb is not None and len(mb) == self.world \
                and sum(mb.values()) == self.total:
            self.microbatches = agreed.microbatches_for(self.dp_rank, self.microbatches)
        # A plan for another world (stale after a restart) changes nothing,
        # and the ack says what this rank runs.
        self.ctl.ack(agreed, **({"microbatches": self.microbatches} if self.rebalance else {}))
        return Step(self.microbatches, self.loss_scale, plan=agreed)

    def _agree(self, newest: int) -> Plan | None:
        """The newest plan every rank has read, or None while some has not:
        one all-reduce (MIN) of (newest, -newest) gives the group's oldest
        and newest reads; equal, every rank holds that plan."""
        import torch
        if self._tensor is None:
            device = "cpu"
            if self._dist.get_backend(self.group) == "nccl":
                device = f"cuda:{torch.cuda.current_device()}"
            self._tensor = torch.empty(2, dtype=torch.int64, device=device)
        t = self._tensor
        t[0], t[1] = newest, -newest
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        lo, hi = int(t[0]), -int(t[1])
        return self._seen.get(lo) if lo == hi else None

    def restart(self, checkpoint: str | os.PathLike) -> int:
        """After this rank saved its part of the checkpoint: ack the restart
        plan; rank 0 asks greyhound-run to relaunch. Returns the exit code
        the trainer exits with (mitigation.control.RESTART_EXIT_CODE)."""
        if self._pending is None:
            raise RuntimeError("no restart plan to follow (Step.restart was None)")
        self.ctl.ack(self._pending)
        if self.rank == 0:
            self.ctl.request_restart(self._pending, str(checkpoint))
        self._pending = None
        return RESTART_EXIT_CODE
