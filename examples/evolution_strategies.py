#!/usr/bin/env python3
"""Evolution strategies (Salimans et al., 2017) over gloo on the CPU: no
gradients and no backward. Every rank evaluates its share of the
population, antithetic pairs of random perturbations of one shared policy,
each an episode of a simulated point mass steered to a target; one
all-gather per iteration then gives every rank every perturbation's
return. Each rank regenerates every perturbation from the shared seed
(the perturbations themselves are never sent) and applies the same
update, so the replicas stay equal. So an iteration is a long stretch of
compute and a single small collective: a job shape Greyhound's rules were
not written around (its corpus records it as held out):

    torchrun --nproc-per-node 3 examples/evolution_strategies.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, loss: minus the population's mean return), with --checksums
`params` (this rank's policy parameters).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


class Policy:
    """A two-layer tanh policy, its parameters one flat vector; evaluated
    for a whole batch of parameter vectors at once."""

    def __init__(self, obs: int, hidden: int, act: int):
        self.shapes = [(obs, hidden), (hidden,), (hidden, act), (act,)]
        self.size = sum(torch.Size(s).numel() for s in self.shapes)

    def act(self, flat: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        """flat (n, size), obs (n, episodes, obs_dim) -> actions."""
        parts, at = [], 0
        for s in self.shapes:
            k = torch.Size(s).numel()
            parts.append(flat[:, at:at + k].reshape(flat.shape[0], *s))
            at += k
        w1, b1, w2, b2 = parts
        h = torch.tanh(obs @ w1 + b1[:, None])
        return torch.tanh(h @ w2 + b2[:, None])


def episode_returns(policy: Policy, flat: torch.Tensor, horizon: int,
                    gen: torch.Generator, episodes: int = 4) -> torch.Tensor:
    """Each parameter vector's mean return over `episodes` episodes of a
    2-D point mass (position, velocity) pushed by the policy's bounded
    force toward a target drawn per episode, from a start drawn per episode
    (the same draws for every vector): minus the mean distance to the
    target, minus a small cost of force."""
    n = flat.shape[0]
    pos = torch.rand(episodes, 2, generator=gen) * 4 - 2
    target = torch.rand(episodes, 2, generator=gen) * 4 - 2
    pos, vel = pos.expand(n, -1, -1).clone(), torch.zeros(n, episodes, 2)
    target = target.expand(n, -1, -1)
    ret = torch.zeros(n, episodes)
    for _ in range(horizon):
        force = policy.act(flat, torch.cat([target - pos, vel], -1))
        vel = 0.9 * vel + 0.1 * force
        pos = pos + 0.1 * vel
        ret -= (target - pos).norm(dim=-1) + 0.01 * force.pow(2).sum(-1)
    return (ret / horizon).mean(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--pairs", type=int, default=24,
                   help="antithetic pairs each rank evaluates per iteration")
    p.add_argument("--horizon", type=int, default=100, help="steps of an episode")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--sigma", type=float, default=0.05, help="perturbation scale")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of the policy's parameters each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = Policy(4, args.hidden, 2)
    theta = torch.randn(policy.size, generator=torch.Generator().manual_seed(args.seed)) * 0.1
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            # Every rank draws every rank's perturbations from the shared
            # seed and evaluates its own slice of them.
            noise = torch.randn(world, args.pairs, policy.size,
                                generator=torch.Generator().manual_seed(
                                    args.seed * 100_003 + step))
            eps = noise[rank]
            flat = theta + args.sigma * torch.cat([eps, -eps])
            env = torch.Generator().manual_seed(args.seed * 7919 + step)
            mine = episode_returns(policy, flat, args.horizon, env)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            r = torch.stack(every)                           # (world, 2 * pairs)
            # Centred ranks of the returns (as in the paper), then the
            # antithetic estimate of the gradient of the expected return.
            ranks = torch.empty(r.numel())
            ranks[r.flatten().argsort()] = torch.arange(r.numel(), dtype=torch.float)
            u = (ranks / (r.numel() - 1) - 0.5).view_as(r)
            w = u[:, :args.pairs] - u[:, args.pairs:]        # (world, pairs)
            grad = (w[..., None] * noise).sum((0, 1)) / (r.numel() * args.sigma)
            theta = theta + args.lr * grad
            if log:
                row = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "loss": round(-float(r.mean()), 6)}
                if args.checksums:
                    row["params"] = float(theta.double().sum())
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
