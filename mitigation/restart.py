"""S3 and S4 in the ski-rental sum: a pipeline re-split or a
checkpoint-restart without the slowest ranks, when the trainer can
checkpoint and the loss a restart would have avoided pays for the
restart's (observed, or estimated) cost. Pure: the policy calls it."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .rebalance import greedy_makespan
from .resplit import gpipe_ms, predict_split, resplit


@dataclass
class Decision:
    strategy: str                 # none / rebalance_microbatches / reconfigure_pipeline / checkpoint_restart
    reason: str
    expected_ms: float | None = None
    plan: dict = field(default_factory=dict)      # ControlWriter.issue keyword arguments
    numbers: dict = field(default_factory=dict)   # the figures behind the decision

    def fields(self) -> dict:
        return {"strategy": self.strategy, "reason": self.reason,
                "expected_ms": None if self.expected_ms is None else round(self.expected_ms, 3),
                "plan": {k: ({str(r): n for r, n in v.items()} if isinstance(v, dict) and
                             k == "microbatches" else v) for k, v in self.plan.items()},
                **{k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in self.numbers.items()}}


def stage_times(announced: dict, ranks: dict, layer_split, recent: int = 32
                ) -> tuple[list[float], list[float], list[float]] | None:
    """Each pipeline stage's time per step that grows with the layers it
    holds, its time that does not, and its compute alone (the first's
    part), from its slowest replica (a stage is as slow as that one;
    medians of its newest `recent` samples).

    What grows: its compute, and its waits in collectives (its gradients'
    all-reduce, one per parameter or bucket of the layers it holds). What
    does not: its point-to-point calls, one send and one receive of the
    activations and gradients per micro-batch, whatever layers it holds.
    On scripts/pipeline_train.py with rank 1 at 0.15 CPU, rank 1 spent 213
    ms per step computing, 70 in its all-reduce and 37 in its sends at
    [4, 4]; at [7, 1], 65, 39 and 40. Everything scaled with the compute
    (the model before this one) predicted the re-split a median 13% low
    over 3 rounds; this one, 4% (bench_mitigation --pipeline, README).

    The slowest stage (the most compute) waits for nobody, so its time in
    calls is its own work; the others' is mostly waiting for it: theirs is
    taken as the same calls at their own speed (compute per layer), at most
    what they measured."""
    def med(q):
        return statistics.median(list(q)[-recent:])
    rows = []
    for st in range(len(layer_split)):
        mine = [r for rank, r in ranks.items() if r.compute_ms
                and announced.get(rank, {}).get("stage") == st]
        if not mine:
            return None
        r = max(mine, key=lambda r: med(r.compute_ms))
        c, d = med(r.compute_ms), med(r.dur_ms)
        p = min(med(r.p2p_ms), max(0.0, d - c)) if r.p2p_ms else 0.0
        rows.append((c, max(0.0, d - c - p), p))         # compute, collectives, p2p
    b = max(range(len(rows)), key=lambda k: rows[k][0])
    cb, ab, pb = rows[b]
    grows, fixed = [], []
    for k, (c, a, p) in enumerate(rows):
        speed = 1.0 if k == b else (c / layer_split[k]) / (cb / layer_split[b])
        grows.append(c + min(a, ab * speed))
        fixed.append(min(p, pb * speed))
    return grows, fixed, [c for c, _, _ in rows]


def restart_decision(announced: dict, ranks: dict, speeds: dict | None, split: dict | None,
                     job_ms: float | None, healthy_ms: float, loss_ms: float,
                     cost: tuple[float, str], min_gain: float,
                     recent: int = 32) -> Decision | None:
    """`ranks`: rank -> samples with `.dur_ms` and `.compute_ms` (a stage's
    time: the median of its newest `recent`); `speeds`: dp rank -> compute
    per micro-batch; `cost`: (seconds, "observed" or "estimated")."""
    def newest(q):
        return list(q)[-recent:]
    if not any(d.get("checkpoint") for d in announced.values()) or job_ms is None:
        return None
    cost_s, how = cost
    stages = {d.get("stage") for d in announced.values()} - {None}
    layer_split = next((d.get("layer_split") for d in announced.values()
                        if d.get("layer_split")), None)
    if layer_split and len(stages) == len(layer_split) > 1:
        times = stage_times(announced, ranks, layer_split, recent)
        if times is None:
            return None
        stage_ms, fixed, compute = times
        rs = resplit(stage_ms, layer_split, fixed=fixed)
        mbs = next((d.get("pp_microbatches") for d in announced.values()
                    if d.get("pp_microbatches")), None)
        # The iteration over the same samples as the stages' times.
        job_ms = statistics.median(statistics.median(newest(r.dur_ms)) for r in ranks.values()
                                   if r.dur_ms)
        best_now = gpipe_ms([t + f for t, f in zip(stage_ms, fixed)], mbs)
        saved = job_ms - predict_split(stage_ms, layer_split, rs.split, job_ms, mbs,
                                       fixed=fixed)
        strategy, plan = "reconfigure_pipeline", {"layer_split": list(rs.split),
                                                 "restart": {"checkpoint": True}}
        what = f"re-split layers {list(layer_split)} -> {list(rs.split)}"
        figures = {"stage_ms": [round(x, 3) for x in stage_ms],
                   "fixed_ms": [round(x, 3) for x in fixed],
                   "compute_ms": [round(x, 3) for x in compute], "microbatches": mbs,
                   "current_ms": job_ms}
    else:
        if speeds is None or split is None or len(speeds) < 2:
            return None
        order = sorted(split)
        total = sum(split.values())
        times = [speeds[k] for k in order]
        med = statistics.median(times)
        best_now = greedy_makespan(times, total)
        # Leave out ranks slower than 2x the median when the others carry
        # the global batch faster than the best split with them.
        keep = [i for i, x in enumerate(times) if x <= 2 * med]
        if len(keep) == len(times) or not keep or total < len(keep):
            return None
        without = greedy_makespan([times[i] for i in keep], total)
        saved = best_now - without
        excluded = [order[i] for i in range(len(order)) if i not in keep]
        # Name where each left-out rank ran (its host, CPUs, GPU, as it
        # announced them), for greyhound-run to relaunch without them.
        where = [{k: d[k] for k in ("rank", "dp_rank", "host", "cpus", "gpu") if k in d}
                 for d in announced.values() if d.get("dp_rank", d.get("rank")) in excluded]
        restart = {"checkpoint": True, "exclude": excluded}
        if where:
            restart["where"] = sorted(where, key=lambda w: w.get("rank", 0))
        strategy, plan = "checkpoint_restart", {"restart": restart}
        figures = {}
        what = f"restart without dp rank(s) {excluded}"
    if saved <= min_gain * best_now:
        return None
    # Rent until the loss the restart would have avoided pays for it.
    avoidable_ms = loss_ms * min(1.0, saved / max(job_ms - healthy_ms, 1e-9))
    if avoidable_ms < cost_s * 1e3:
        return None
    return Decision(strategy, f"{what}: {avoidable_ms / 1e3:.1f} s lost reached the "
                              f"{how} restart cost of {cost_s:.1f} s",
                    max(0.0, job_ms - saved), plan,
                    {"cost_ms": cost_s * 1e3, "cost": how, "saved_ms": saved,
                     **figures})
