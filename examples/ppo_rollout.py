#!/usr/bin/env python3
"""PPO under DDP, the loop of reinforcement learning's on-policy trainers
(CleanRL's, and RLHF's at a far larger scale): every iteration each rank
first rolls its policy out in its own vectorized environments (CartPole's
physics, written in torch): forward passes only and no collective at all,
about a third of the iteration; then it updates the policy for 4 epochs
of 4 minibatches under DDP (CleanRL's defaults), each one an all-reduce
of the gradients; then the ranks all-reduce the episode returns for the
log. So the collectives come in a burst after a silent stretch, the
iteration is long (about 270 ms at 3 ranks on 2 cores), and each rank's
rollout is its own (its episodes end and reset on their own). The CPU
over gloo. A job shape
Greyhound's rules were not written around (its corpus records it as held
out):

    torchrun --nproc-per-node 3 examples/ppo_rollout.py
    sudo greyhound-trace attach <torchrun's PID>

--truth FILE logs each iteration (JSON lines: rank, index, start_ns,
dur_ns, rollout_ns, `return` (the mean return of the episodes the ranks
finished, all-reduced), and with --checksums `params`: a checksum of this
rank's model) for the tests and benchmarks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class CartPole:
    """`n` cart-poles stepped together (the classic-control equations,
    Euler steps of 20 ms); an episode ends when the pole falls past 12
    degrees or the cart leaves the track, and that one starts again."""

    def __init__(self, n: int, gen: torch.Generator):
        self.gen, self.n = gen, n
        self.state = self._fresh(n)
        self.ret = torch.zeros(n)

    def _fresh(self, k: int) -> torch.Tensor:
        return (torch.rand(k, 4, generator=self.gen) - 0.5) * 0.1

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        x, v, th, w = self.state.unbind(1)
        force = (action.float() * 2 - 1) * 10.0
        cos, sin = torch.cos(th), torch.sin(th)
        tmp = (force + 0.05 * w * w * sin) / 1.1
        acc_th = (9.8 * sin - cos * tmp) / (0.5 * (4 / 3 - 0.1 * cos * cos / 1.1))
        acc_x = tmp - 0.05 * acc_th * cos / 1.1
        self.state = torch.stack([x + 0.02 * v, v + 0.02 * acc_x, th + 0.02 * w,
                                  w + 0.02 * acc_th], 1)
        done = (self.state[:, 0].abs() > 2.4) | (self.state[:, 2].abs() > 12 * math.pi / 180)
        self.ret += 1
        finished = self.ret[done].tolist()
        if done.any():
            self.state[done] = self._fresh(int(done.sum()))
            self.ret[done] = 0
        return self.state.clone(), done.float(), finished


class ActorCritic(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                nn.Tanh(), nn.Linear(hidden, 2))
        self.v = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                               nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, obs):
        return self.pi(obs), self.v(obs).squeeze(-1)


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return round(sum(float(p.double().sum()) for p in model.parameters()), 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="iterations (0: until killed)")
    p.add_argument("--envs", type=int, default=16, help="environments per rank")
    p.add_argument("--horizon", type=int, default=128, help="rollout steps per iteration")
    p.add_argument("--epochs", type=int, default=4, help="update epochs per iteration")
    p.add_argument("--minibatches", type=int, default=4, help="minibatches per epoch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--truth", help="append per-iteration ground truth here (JSON lines)")
    p.add_argument("--checksums", action="store_true",
                   help="log a checksum of this rank's model with each iteration")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(ActorCritic(args.hidden))
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    env = CartPole(args.envs, gen)
    obs = env.state.clone()
    T, N = args.horizon, args.envs
    log = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    try:
        while not args.steps or step < args.steps:
            t0 = time.time_ns()
            # Rollout: this rank's own environments, no collective.
            o_buf, a_buf, lp_buf = torch.zeros(T, N, 4), torch.zeros(T, N), torch.zeros(T, N)
            r_buf, d_buf, v_buf = torch.zeros(T, N), torch.zeros(T, N), torch.zeros(T, N)
            finished: list[float] = []
            with torch.no_grad():
                for t in range(T):
                    logits, value = model.module(obs)
                    dist_a = torch.distributions.Categorical(logits=logits)
                    action = dist_a.sample()
                    o_buf[t], a_buf[t], lp_buf[t], v_buf[t] = obs, action, \
                        dist_a.log_prob(action), value
                    obs, done, ended = env.step(action)
                    r_buf[t], d_buf[t] = 1.0, done
                    finished += ended
                _, last_v = model.module(obs)
                adv, gae = torch.zeros(T, N), torch.zeros(N)
                for t in reversed(range(T)):
                    nxt = last_v if t == T - 1 else v_buf[t + 1]
                    delta = r_buf[t] + 0.99 * nxt * (1 - d_buf[t]) - v_buf[t]
                    gae = delta + 0.99 * 0.95 * (1 - d_buf[t]) * gae
                    adv[t] = gae
                ret = adv + v_buf
            rollout_ns = time.time_ns() - t0
            # Update: minibatches under DDP, each an all-reduce.
            b_o, b_a, b_lp = o_buf.reshape(-1, 4), a_buf.reshape(-1), lp_buf.reshape(-1)
            b_adv, b_ret = adv.reshape(-1), ret.reshape(-1)
            size = T * N // args.minibatches
            for _ in range(args.epochs):
                perm = torch.randperm(T * N, generator=gen)
                for m in range(args.minibatches):
                    idx = perm[m * size:(m + 1) * size]
                    logits, value = model(b_o[idx])
                    d = torch.distributions.Categorical(logits=logits)
                    ratio = (d.log_prob(b_a[idx]) - b_lp[idx]).exp()
                    a = b_adv[idx]
                    a = (a - a.mean()) / (a.std() + 1e-8)
                    pg = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
                    loss = pg + 0.5 * (value - b_ret[idx]).pow(2).mean() \
                        - 0.01 * d.entropy().mean()
                    opt.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
            # The episodes' returns, over every rank, for the log.
            stats = torch.tensor([sum(finished), float(len(finished))])
            dist.all_reduce(stats)
            mean_return = float(stats[0] / stats[1]) if stats[1] else None
            if log:
                rec = {"rank": rank, "index": step, "start_ns": t0,
                       "dur_ns": time.time_ns() - t0, "rollout_ns": rollout_ns,
                       "return": mean_return}
                if args.checksums:
                    rec["params"] = checksum(model)
                log.write(json.dumps(rec) + "\n")
            if rank == 0 and (step + 1) % 50 == 0:
                print(f"iteration {step + 1}: mean return {mean_return}", flush=True)
            step += 1
    except KeyboardInterrupt:
        pass
    if log:
        log.write(json.dumps({"rank": rank, "final": True, "steps": step}) + "\n")
        log.close()
    dist.destroy_process_group()
    # Leave at once, as the other examples do (gloo's destructors can hang
    # at exit: pytorch/pytorch#56297).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
