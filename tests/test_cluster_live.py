"""Many machines, for real, on one (issue #14): two network namespaces are
two nodes; a real `torchrun --nnodes 2` (c10d rendezvous across the
bridge, gloo over each namespace's veth) runs 2 ranks on each; each node
has its own `greyhound-trace attach --cluster` agent, and one
`greyhound-trace controller` leads. Redis is the real redis-server on the
bridge's address, with TLS (a CA made here) and one ACL user each.

One run, no retries:
- healthy: every rank announced once, the nodes' communicator maps merged
  into the job's, nothing named, nothing planned;
- a CPU quota on a rank of node n1: the controller names that rank, its
  cause and its node; asked by the controller, each node's agent measures
  its own devices, and the merged measurements name the same; the plan is
  written to both nodes' control files and applied by all four ranks at one
  step, the global batch kept;
- `kill -9` of node n0's agent: `agent_lost` with its ranks, no verdict on
  them; a new agent there rejoins and the census is whole again.
"""
import os
import signal
import subprocess
import time

import pytest

from greyhound_bpf.diagnosis.cpu import cpu_controller, remove_stale_idle_groups
from greyhound_bpf.inject import CpuQuota, leftover_groups
from harness import GREYHOUND, ROOT, JsonlTail, cpu_share, kill_tree, rank_pids, wait_for
from netbed import NetBed
from redisbed import RedisBed

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

RUN_ID = "ghcl"
TRAIN = ("--microbatches", "4", "--mb-size", "256", "--hidden", "128", "--layers", "3",
         "--bucket-mb", "25")


def test_two_nodes_one_controller(tmp_path, tracer):
    before = leftover_groups()
    bed = NetBed(2, prefix="ghc", subnet="10.213.0")
    procs: list[subprocess.Popen] = []             # the controller, whatever happens
    with bed:
        redis = RedisBed(tmp_path, RUN_ID, ["n0", "n1"], bind=bed.addr(bed.HOST),
                         tls=True).start()
        try:
            _run(tmp_path, bed, redis, tracer, procs)
        finally:
            _stop(procs)
            redis.stop()
    assert bed.leftovers() == []
    # The kill -9'd agent's idle group outlives it until an attach starts
    # (which removes it, as here, once its validation workers are gone).
    wait_for(lambda: not remove_stale_idle_groups(cpu_controller()) and
             set(leftover_groups()) <= set(before), 30, "no group left",
             why=lambda: leftover_groups())


def _stop(procs: list[subprocess.Popen]) -> None:
    """The controller (and what else a test started), whatever happened."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                kill_tree(p)


def _run(tmp_path, bed, redis, tracer, procs):
    ca = str(redis.certs["ca.pem"])
    control = {i: tmp_path / f"n{i}" / "ctl.json" for i in range(2)}
    truth = {i: tmp_path / f"n{i}" / "truth.jsonl" for i in range(2)}
    port = 29500 + os.getpid() % 400
    jobs = {}
    for i in range(2):
        control[i].parent.mkdir()
        jobs[i] = bed.start_torchrun(i, 2, RUN_ID, port, truth[i], *TRAIN, "--control-file",
                                     str(control[i]), log=tmp_path / f"torchrun-n{i}.out")
    ranks = {i: wait_for(lambda i=i: (lambda r: r if len(r) == 2 else None)(
        rank_pids(jobs[i].pid)), 120, f"node n{i}'s 2 ranks") for i in range(2)}
    node_of = {r: f"n{i}" for i in range(2) for r in ranks[i]}
    assert sorted(node_of) == [0, 1, 2, 3]
    truths = {i: JsonlTail(truth[i]) for i in range(2)}
    wait_for(lambda: all(len(truths[i].read()) >= 20 for i in range(2)) or None, 120,
             "both nodes to train")

    events_path = tmp_path / "controller.jsonl"
    ctl_out = open(tmp_path / "controller.out", "w")
    ctl = subprocess.Popen(
        [*GREYHOUND, "controller", "--cluster", redis.url, "--job", RUN_ID, "--cluster-ca", ca,
         "--cluster-secret", str(redis.secret_file("controller")), "-o", str(events_path),
         # --always-validate: the straggler's plan would confirm its verdict
         # (no measurement); here the nodes' measurements are what is tested.
         "--mitigate", "--always-validate", "--record", str(tmp_path / "controller.rec.gz")],
        cwd=ROOT,
        stdout=ctl_out, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(ctl)
    events = JsonlTail(events_path)
    seen = events.all                      # every event so far (read() appends)

    def kind(k):
        return [e for e in events.read() if e["kind"] == k]

    def story():
        return "\n".join(str({k: e.get(k) for k in ("kind", "node", "ranks", "nodes", "cause",
                                                    "evidence", "strategy", "seq", "reason")})
                         for e in seen if e["kind"] not in ("iteration",))

    def agent(i):
        return tracer([jobs[i].pid], "-q", "--cluster", redis.url, "--node", f"n{i}",
                      "--cluster-ca", ca, "--cluster-secret",
                      str(redis.secret_file(f"agent-n{i}")), "--control-file", str(control[i]),
                      name=f"agent-n{i}")

    agents = {i: agent(i) for i in range(2)}
    for a in agents.values():
        a.wait_attached(2)
    census = wait_for(lambda: [c for c in kind("census") if c["complete"]], 60,
                      "every rank announced", why=story)[0]
    assert census["world"] == 4
    assert {int(r): n for r, n in census["where"].items()} == {r: [n] for r, n in
                                                               node_of.items()}
    # The job's communicator map: each node's agent sees its own two ranks'
    # gloo calls; the controller's merge holds all four.
    wait_for(lambda: [e for e in kind("topology") if [0, 1, 2, 3] in
                      [c["ranks"] for c in e["communicators"]]], 60,
             "the job's communicator map", why=story)

    # Healthy: each agent has measured its ranks a while; nothing is named.
    for a in agents.values():
        wait_for(lambda a=a: min(len(a.measured(r)) for r in
                                 {e["rank"] for e in a.attached_ranks()}) >= 60, 120,
                 "60 measured iterations per rank", interval=0.5)
    time.sleep(5)
    assert [e for e in kind("diagnosis") if e["cause"] != "unknown"] == [], story()
    assert [e for e in kind("action") if e.get("seq") is not None] == [], story()

    # A straggler on node n1.
    slow = min(ranks[1])
    with CpuQuota(ranks[1][slow], max(0.02, cpu_share(ranks[1][slow], 3) / 3)):
        start = time.time_ns()
        def verdict(evidence):
            return [e for e in kind("diagnosis") if e["time_ns"] > start
                    and e["cause"] != "unknown" and e["evidence"] == evidence]
        named = wait_for(lambda: verdict("passive"), 60, "the controller's verdict",
                         interval=0.5, why=story)[0]
        assert (named["cause"], named["ranks"], named["nodes"]) == \
            ("computation", [slow], ["n1"]), story()
        # Validated: each node's agent measured its own devices.
        measured = wait_for(lambda: verdict("validation"), 90, "the nodes' measurements",
                            interval=0.5, why=story)[0]
        assert (measured["cause"], measured["ranks"], measured["nodes"]) == \
            ("computation", [slow], ["n1"]), story()
        assert sorted(measured["details"]["devices"]) == ["0", "1", "2", "3"], measured
        assert measured["details"]["paused_s"] <= 5
        applied = wait_for(lambda: kind("applied"), 90, "a plan applied by every rank",
                           interval=0.5, why=story)[0]
    assert applied["ranks"] == [0, 1, 2, 3], story()
    plan = next(e for e in kind("action") if e.get("seq") == applied["seq"])
    mb = {int(r): n for r, n in plan["plan"]["microbatches"].items()}
    assert sum(mb.values()) == 16 and mb[slow] < 4, plan
    # Every rank ran the plan from the same step (the trainers' own logs),
    # and every step kept the global batch.
    steps: dict[int, dict[int, int]] = {}
    for i in range(2):
        for d in truths[i].read():
            if not d.get("final"):
                steps.setdefault(d["index"], {})[d["rank"]] = d["microbatches"]
    whole = {i: s for i, s in steps.items() if len(s) == 4}
    assert all(sum(s.values()) == 16 for s in whole.values()), whole
    switched = min(i for i, s in whole.items() if s == mb)
    assert all(s == {r: 4 for r in range(4)} for i, s in whole.items() if i < switched), whole
    for e in kind("diagnosis"):
        assert e["cause"] == "unknown" or e["ranks"] == [slow], story()

    # kill -9 of node n0's agent, then a new one.
    os.kill(agents[0].proc.pid, signal.SIGKILL)
    lost = wait_for(lambda: kind("agent_lost"), 15, "agent_lost", why=story)[0]
    assert (lost["node"], lost["ranks"]) == ("n0", sorted(ranks[0])), lost
    at = len(seen)
    time.sleep(3)
    events.read()
    assert not [e for e in seen[at:] if e["kind"] == "diagnosis"
                and set(e["ranks"]) & set(ranks[0])], story()
    agents[0] = agent(0)
    wait_for(lambda: [e for e in kind("agent") if e["node"] == "n0" and e["rejoined"]], 60,
             "node n0's new agent", why=story)
    wait_for(lambda: kind("census")[-1]["complete"], 30, "the census whole again", why=story)
    for a in agents.values():
        a.stop()


# A communication-heavy job (the link test's): 200mbit makes its collectives
# 3-4x as long.
LINK_TRAIN = ("--microbatches", "2", "--mb-size", "64", "--hidden", "512", "--layers", "4",
              "--bucket-mb", "1")


def test_three_nodes_one_slow_link_then_one_slow_device(tmp_path, tracer):
    """Three nodes, one rank each (with two, either end of the one path
    between them could be the slow one): a 200mbit tbf on node n1's veth.
    Asked by the controller, every agent runs its side of the edges between
    nodes (workers on both ends, their own rendezvous through the command
    stream); the merged measurements name node n1's link. Then, the link
    back, a CPU quota on node n2's rank: alone on its node, its device is
    measured with no witness beside it, so the controller measures it again
    beside the fastest (the second look), and a slow device stays slow."""
    bed = NetBed(3, prefix="ghk", subnet="10.214.0")
    procs: list[subprocess.Popen] = []
    with bed:
        redis = RedisBed(tmp_path, "ghlk", ["n0", "n1", "n2"],
                         bind=bed.addr(bed.HOST)).start()
        try:
            _run_links(tmp_path, bed, redis, tracer, procs)
        finally:
            _stop(procs)
            redis.stop()
        assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", bed.host_dev(1)],
                                           capture_output=True, text=True).stdout
    assert bed.leftovers() == []


def _run_links(tmp_path, bed, redis, tracer, procs):
    port = 29100 + os.getpid() % 300
    jobs = {i: bed.start_torchrun(i, 1, "ghlk", port, tmp_path / f"truth-n{i}.jsonl",
                                  *LINK_TRAIN, log=tmp_path / f"torchrun-n{i}.out")
            for i in range(3)}
    rank = {i: wait_for(lambda i=i: (lambda r: r if len(r) == 1 else None)(
        rank_pids(jobs[i].pid)), 120, f"node n{i}'s rank") for i in range(3)}
    on_n1 = next(iter(rank[1]))
    events_path = tmp_path / "controller.jsonl"
    recording = tmp_path / "controller.rec.gz"
    procs.append(subprocess.Popen(
        [*GREYHOUND, "controller", "--cluster", redis.url, "--job", "ghlk",
         "--cluster-secret", str(redis.secret_file("controller")), "-o", str(events_path),
         # Two faults a minute apart, each validated (the second look a
         # pause too), where the default budget is 6 s in 10 minutes.
         "--pause-budget", "0.05", "--record", str(recording)],
        cwd=ROOT, stdout=open(tmp_path / "controller.out", "w"), stderr=subprocess.STDOUT,
        start_new_session=True))
    events = JsonlTail(events_path)

    def kind(k):
        return [e for e in events.read() if e["kind"] == k]

    def story():
        return "\n".join(str({k: e.get(k) for k in ("kind", "node", "ranks", "nodes", "cause",
                                                    "link", "evidence", "reason")})
                         for e in events.all if e["kind"] != "iteration") + \
            "\n" + (tmp_path / "controller.out").read_text()

    agents = [tracer([jobs[i].pid], "-q", "--cluster", redis.url, "--node", f"n{i}",
                     "--cluster-secret", str(redis.secret_file(f"agent-n{i}")),
                     name=f"agent-n{i}") for i in range(3)]
    for a in agents:
        a.wait_attached(1)
    wait_for(lambda: [c for c in kind("census") if c["complete"]], 60, "every rank announced",
             why=story)
    for i, a in enumerate(agents):
        wait_for(lambda a=a, r=next(iter(rank[i])): len(a.measured(r)) >= 60, 120,
                 f"60 measured iterations on n{i}", interval=0.5)
    time.sleep(3)
    assert [e for e in kind("diagnosis") if e["cause"] != "unknown"] == [], story()

    start = time.time_ns()
    inj = subprocess.Popen([*GREYHOUND, "inject", "link", "--dev", bed.host_dev(1),
                            "--rate", "200mbit", "--for", "90"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(inj)
    measured = wait_for(lambda: [e for e in kind("diagnosis") if e["time_ns"] > start
                                 and e["evidence"] == "validation"], 150,
                        "the merged measurements", interval=0.5, why=story)[0]
    assert (measured["cause"], measured["link"], measured["ranks"], measured["nodes"]) == \
        ("communication", "node n1", [on_n1], ["n1"]), story()
    links = measured["details"]["links"]
    assert len(links) == 3, links                    # every edge between the nodes
    assert measured["details"]["untested"] == [], measured["details"]
    assert measured["details"]["paused_s"] <= 5
    assert not [e for e in kind("diagnosis") if e["cause"] == "computation"], story()
    # The limit is lifted from the signal on: the job's recovery can be
    # reported before inject has exited (in a CI run at 63a1bf7 it was, and
    # went unseen while this time was taken after inject's exit).
    lifted = time.time_ns()
    inj.send_signal(signal.SIGINT)
    out, _ = inj.communicate(timeout=30)
    assert "undone" in out, out
    wait_for(lambda: [e for e in kind("recovery") if e["time_ns"] > lifted
                      and e["scope"] == "job"], 90, "the job back to its speed", interval=0.5,
             why=story)
    # A slow device alone on its node: measured slow on the nodes' pass,
    # measured again beside the fastest, slow both times, and named.
    on_n2 = next(iter(rank[2]))
    with CpuQuota(rank[2][on_n2], max(0.02, cpu_share(rank[2][on_n2], 3) / 3)):
        start = time.time_ns()
        device = wait_for(lambda: [e for e in kind("diagnosis") if e["time_ns"] > start
                                   and e["evidence"] == "validation"], 150,
                          "the slow device measured", interval=0.5, why=story)[0]
    assert (device["cause"], device["ranks"], device["nodes"]) == \
        ("computation", [on_n2], ["n2"]), story()
    devices = device["details"]["devices"]
    assert sorted(map(int, devices)) == sorted(next(iter(rank[i])) for i in range(3)), devices
    assert devices[str(on_n2)]["passes"] == 2, devices
    assert "measured slow on one pass: measured again" in \
        (tmp_path / "controller.out").read_text(), story()
    assert device["details"]["paused_s"] <= 5
    for a in agents:
        a.stop()
    # The controller's analysis is replayable: its recording gives its verdicts.
    procs[0].send_signal(signal.SIGINT)
    procs[0].wait(30)
    from greyhound_bpf.replay import replay
    said = [(e["kind"], e.get("cause"), e.get("link"), e.get("ranks")) for e in events.read()
            if e["kind"] in ("slowdown", "diagnosis")]
    again = [(e["kind"], e.get("cause"), e.get("link"), e.get("ranks"))
             for e in replay(str(recording)) if e["kind"] in ("slowdown", "diagnosis")]
    assert again == said
