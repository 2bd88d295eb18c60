"""The controller at scale, simulated (issue #14): the real
`greyhound-trace controller` reading a real redis-server on loopback,
driven by synthetic agents (a few processes, many nodes' agents each) that
publish what `attach --cluster` publishes, for up to 1,024 nodes x 8 ranks.

The job model runs on the wall clock: a data-parallel job whose ranks each
compute (BASE_MS x noise; rank 0 a little more), then meet in an all-reduce
that ends when the slowest has arrived, plus the collective's own time. A
rank's `comm_ns` is its wait plus the collective, as the probes see it. A
compute fault (`--fault compute`, the default) multiplies one rank's compute
by FACTOR from HEALTHY_S on; a link fault (`--fault link`) one node's link
by LINK_FACTOR: a ring all-reduce runs at its slowest link, so every rank's
collective takes that much longer.
Every agent process computes the whole job from the seed (the collective
needs every rank) and publishes its own nodes', four batches a second, with
a heartbeat a second per node.

The synthetic agents publish; they do not measure (the controller runs with
--no-validate): its verdicts here are passive, cross-sectional ones.

Reported per size, in one run, with the truth the simulator knows:
- the controller's CPU per second of job time (against one core: the limit);
- latency: from an iteration's end to the controller's event it caused
  (agent batching, the controller's hold, its processing), median and max;
- detection: time from the fault's onset to the verdict naming its rank and
  node (a link fault: the verdict `communication`; passively the slow node
  cannot be told from the others, every rank waits alike: validation's
  links between nodes name it, tests/test_cluster_live.py), verdicts naming
  anything else, and named verdicts while healthy;
- Redis memory at the end.

    scripts/bench_cluster                          # 64, 1,024 and 8,192 ranks
    scripts/bench_cluster --nodes 1024 --seed 3    # one size
    scripts/bench_cluster --fault link             # a node's slow link
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from harness import cpu_seconds  # noqa: E402

JOB = "bench"
PER_NODE = 8
# A large job's iteration takes seconds (8,192 GPUs run a large model): 1.2 s.
BASE_MS, COLL_MS = 1000.0, 200.0
FACTOR = 1.8
LINK_FACTOR = 4.0
HEALTHY_S, FAULT_S = 30.0, 40.0
FLUSH_S, HEARTBEAT_S = 0.25, 1.0


# -- the job model ------------------------------------------------------------------

def iteration(rng: np.random.Generator, ranks: int, fault: tuple | None) -> tuple:
    """(per-rank compute ms, the iteration's ms); `fault`: ("compute",
    rank) or ("link", node), or None."""
    c = BASE_MS * np.clip(1 + 0.03 * rng.standard_normal(ranks), 0.8, 1.3)
    c[0] *= 1.02
    if fault is not None and fault[0] == "compute":
        c[fault[1]] *= FACTOR
    coll = COLL_MS * max(0.5, 1 + 0.05 * rng.standard_normal())
    if fault is not None and fault[0] == "link":
        coll *= LINK_FACTOR
    return c, float(c.max() + coll)


def agents(url: str, password: str, nodes: list[int], world: int, seed: int, t0: float,
           fault: tuple) -> None:
    """One agent process: the nodes `nodes`' agents."""
    import redis

    from greyhound_bpf.cluster.bus import AgentBus
    r = redis.Redis.from_url(url, username="sim-agents", password=password)
    pipe = r.pipeline(transaction=False)
    bus = {n: AgentBus(pipe, JOB, f"n{n}", f"{os.getpid()}-{n}") for n in nodes}
    for n in nodes:
        bus[n].hello(time.time_ns(), [
            {"pid": 1000 + k, "rank": n * PER_NODE + k, "local_rank": k, "world_size": world,
             "comm": "sim"} for k in range(PER_NODE)])
    pipe.execute()
    rng = np.random.default_rng(seed)
    mine = np.concatenate([np.arange(n * PER_NODE, (n + 1) * PER_NODE) for n in nodes])
    pending: dict[int, dict[int, list]] = {n: {} for n in nodes}
    start_ns, index = int(t0 * 1e9) + time.time_ns() - time.monotonic_ns(), 0
    next_flush = next_hb = time.monotonic()
    end = t0 + HEALTHY_S + FAULT_S
    while time.monotonic() < end:
        c, dur = iteration(rng, world, fault if time.monotonic() - t0 >= HEALTHY_S else None)
        end_ns = start_ns + int(dur * 1e6)
        # Publish, a few times a second, until this iteration has ended.
        while True:
            now = time.monotonic()
            if now >= next_flush:
                t = time.time_ns()
                for n in nodes:
                    if pending[n]:
                        bus[n].iterations(t, pending[n])
                        pending[n] = {}
                if now >= next_hb:
                    for n in nodes:
                        bus[n].heartbeat(t)
                    next_hb = now + HEARTBEAT_S
                pipe.execute()
                next_flush = now + FLUSH_S
            left = (end_ns - time.time_ns()) / 1e9
            if left <= 0:
                break
            time.sleep(min(left, max(0.0, next_flush - time.monotonic())) + 1e-4)
        for rank in mine:                    # it has ended: the agents have it
            n, k = divmod(int(rank), PER_NODE)
            comp = int(c[rank] * 1e6)
            pending[n].setdefault(1000 + k, []).append(
                {"index": index, "start_ns": start_ns, "dur_ns": end_ns - start_ns,
                 "period_calls": 2, "comm_ns": end_ns - start_ns - comp, "compute_ns": comp})
        start_ns, index = end_ns, index + 1


# -- one size -------------------------------------------------------------------------

class Redis:
    def __init__(self, d: Path):
        self.d, self.port = d, _free_port()
        self.pw = {"controller": secrets.token_hex(8), "sim-agents": secrets.token_hex(8)}
        (d / "redis.conf").write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {d}\nsave \"\"\nappendonly no\n"
            "user default off\n"
            f"user controller on >{self.pw['controller']} ~gh:{JOB}:* +@stream +scan +set "
            "+get +incrby +eval +pexpire +del +ping +hello +auth +info\n"
            f"user sim-agents on >{self.pw['sim-agents']} ~gh:{JOB}:ev:* +xadd +ping +hello "
            "+auth\n")
        exe = shutil.which("redis-server")
        if not exe:
            sys.exit("bench_cluster: redis-server is missing: run sudo scripts/setup")
        self.proc = subprocess.Popen([exe, str(d / "redis.conf")], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        import redis
        self.r = redis.Redis(port=self.port, username="controller",
                             password=self.pw["controller"])
        for _ in range(100):
            try:
                self.r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_size(nodes: int, procs: int, seed: int, work: Path, kind: str = "compute") -> dict:
    from harness import JsonlTail
    world = nodes * PER_NODE
    rng = np.random.default_rng(seed)
    fault_rank = int(rng.integers(1, world))
    fault = ("compute", fault_rank) if kind == "compute" else ("link", fault_rank // PER_NODE)
    redis = Redis(work)
    events_path = work / "controller.jsonl"
    ctl = subprocess.Popen(
        [sys.executable, "-m", "greyhound_bpf.cli", "controller", "--cluster", redis.url,
         "--job", JOB, "--no-validate", "-o", str(events_path)], cwd=ROOT, stdout=open(work / "ctl.out", "w"),
        stderr=subprocess.STDOUT, env={**os.environ, "GREYHOUND_REDIS_PASSWORD":
                                       redis.pw["controller"]})
    tail = JsonlTail(events_path)
    arrived: dict[int, float] = {}            # event position -> wall arrival
    time.sleep(3.0)                           # the controller's imports
    t0 = time.monotonic() + 2.0
    groups = [list(range(nodes))[i::procs] for i in range(procs)]
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    sims = [ctx.Process(target=agents, args=(redis.url, redis.pw["sim-agents"], g, world,
                                             seed + 1, t0, fault)) for g in groups if g]
    for p in sims:
        p.start()
    fault_wall_ns = time.time_ns() + int((t0 + HEALTHY_S - time.monotonic()) * 1e9)
    cpu0 = None
    while any(p.is_alive() for p in sims) or time.monotonic() < t0 + HEALTHY_S + FAULT_S + 3:
        evs = tail.read()
        now = time.time_ns()
        for i in range(len(arrived), len(evs)):
            arrived[i] = now
        if cpu0 is None and time.monotonic() >= t0 + 5:
            cpu0, c_t0 = cpu_seconds(ctl.pid), time.monotonic()
        time.sleep(0.05)
    cpu = (cpu_seconds(ctl.pid) - cpu0) / (time.monotonic() - c_t0)
    mem = redis.r.info("memory")["used_memory"]
    ctl.send_signal(signal.SIGINT)
    ctl.wait(30)
    for p in sims:
        p.join(5)
    redis.close()
    evs = tail.read()
    lat = [(arrived[i] - e["time_ns"]) / 1e9 for i, e in enumerate(evs)
           if e["kind"] in ("slowdown", "recovery", "diagnosis") and i in arrived]
    named = [(i, e) for i, e in enumerate(evs) if e["kind"] == "diagnosis"
             and (e.get("ranks") or e["cause"] != "unknown")]
    if kind == "compute":
        right = [(i, e) for i, e in named if e["ranks"] == [fault_rank] and e["time_ns"] >=
                 fault_wall_ns and e.get("nodes") == [f"n{fault_rank // PER_NODE}"]]
    else:
        right = [(i, e) for i, e in named if e["cause"] == "communication"
                 and e["time_ns"] >= fault_wall_ns]
    wrong = [e for i, e in named if (i, e) not in right]
    census = [e for e in evs if e["kind"] == "census"]
    return {"nodes": nodes, "ranks": world, "agent_processes": len(sims),
            "fault": list(fault),
            "census_complete": bool(census and census[-1]["complete"]),
            "controller_cpu_per_s": round(cpu, 3),
            "latency_median_s": round(statistics.median(lat), 2) if lat else None,
            "latency_max_s": round(max(lat), 2) if lat else None,
            "detected_after_s": round((arrived[right[0][0]] - fault_wall_ns) / 1e9, 1)
            if right else None,
            "right": bool(right), "wrong_verdicts": len(wrong),
            "healthy_false": len([e for i, e in named if e["time_ns"] < fault_wall_ns]),
            "redis_mb": round(mem / 2**20, 1),
            "iterations_sent": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, action="append",
                    help="nodes (x8 ranks), repeatable (default 8, 128, 1024)")
    ap.add_argument("--procs", type=int, default=4, help="agent processes (default 4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault", choices=("compute", "link"), default="compute",
                    help="one rank's compute x1.8 (default), or one node's link x4")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    a = ap.parse_args()
    rows = []
    print(f"{'ranks':>6} {'nodes':>5} {'ctl CPU/s':>9} {'lat med':>7} {'lat max':>7} "
          f"{'found in':>8} {'right':>5} {'wrong':>5} {'healthy':>7} {'redis':>8}", flush=True)
    for n in a.nodes or [8, 128, 1024]:
        d = Path(tempfile.mkdtemp(prefix="gh-bench-cluster-"))
        r = run_size(n, min(a.procs, n), a.seed, d, a.fault)
        if r["right"]:
            shutil.rmtree(d)
        else:
            print(f"(kept {d}: the controller's output)", flush=True)
        rows.append(r)
        print(f"{r['ranks']:>6} {r['nodes']:>5} {r['controller_cpu_per_s']:>9.2f} "
              f"{_s(r['latency_median_s']):>7} {_s(r['latency_max_s']):>7} "
              f"{_s(r['detected_after_s']):>8} {'yes' if r['right'] else 'NO':>5} "
              f"{r['wrong_verdicts']:>5} {r['healthy_false']:>7} {r['redis_mb']:>6.1f}MB",
              flush=True)
    print(f"(controller CPU: seconds per second of job time; 1.00 is one core, its limit. "
          f"latency: an iteration's end to the controller's event; found in: the fault's "
          f"onset to the verdict naming its rank and node (a link: `communication`); "
          f"healthy: named verdicts before the fault; {a.fault} fault, seed {a.seed})")
    if a.json:
        print(json.dumps(rows))
    return 0 if all(r["right"] and not r["wrong_verdicts"] for r in rows) else 1


def _s(v) -> str:
    return "-" if v is None else f"{v:.1f}s"


if __name__ == "__main__":
    sys.exit(main())
