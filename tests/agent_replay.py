"""A node's agent (the real cluster.agent.Agent, in its own process) that
publishes part of a recorded job: the recording is replayed through a local
JobAnalysis, as `attach` would have analysed it live, and the agent gets
the events of the ranks on its node, as `attach --cluster` hands them over.
Then it stays, heartbeating, until killed or told to stop (SIGTERM).

    python tests/agent_replay.py URL JOB NODE RANKS RECORDING SECRET_FILE SPEED
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greyhound_bpf.analysis import JobAnalysis, Targets  # noqa: E402
from greyhound_bpf.cluster.agent import Agent  # noqa: E402
from greyhound_bpf.cluster.connect import endpoint  # noqa: E402
from greyhound_bpf.probe.catalog import load_catalog  # noqa: E402
from greyhound_bpf.recording import Recording  # noqa: E402


def feed(agent: Agent, recording: str, ranks: set[int], speed: float) -> int:
    """At `speed` times the recorded pace, as `attach` would hand them over."""
    cat = load_catalog()
    rec = Recording(recording, cat)
    local = JobAnalysis(cat, rec.job, rec.config)
    n, t0, wall0 = 0, None, time.monotonic()
    for inp in rec.inputs():
        t0 = t0 or inp.t_ns
        ahead = (inp.t_ns - t0) / 1e9 / speed - (time.monotonic() - wall0)
        if ahead > 0:
            time.sleep(ahead)
        if isinstance(inp, Targets) and inp.added:
            mine = [d for d in inp.added if d.get("rank") in ranks]
            if mine:
                agent.sink({"kind": "attach", "time_ns": inp.t_ns, "ranks": mine})
        for ev in local.feed(inp):
            if ev["kind"] == "iteration" and ev.get("rank") in ranks:
                agent.sink(ev)
                n += 1
        agent.collectives({r: v for r, v in local.shared_collectives().items() if r in ranks})
    return n


def main() -> int:
    url, job, node, ranks, recording, secret, speed = sys.argv[1:8]
    agent = Agent(endpoint(url, f"agent-{node}", secret), job, node,
                  say=lambda m: print(m, flush=True))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    n = feed(agent, recording, {int(r) for r in ranks.split(",")}, float(speed))
    print(f"fed {n} iterations", flush=True)
    done.wait()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
