"""The controller and its agents over a real redis-server (issue #14).

Agents are the real cluster.agent.Agent, each in its own process
(tests/agent_replay.py), publishing the ranks of its node from a recorded
real job (the corpus's compute-demo4-r2: 4 gloo ranks, rank 2 under a CPU
quota); the controller is the real Controller over the real consumer
group. Tried:
- the controller names the slow rank and its node, and the census says
  every rank was announced once;
- `kill -9` of an agent: `agent_lost` after 3 heartbeats, its ranks leave
  the analysis (no verdict on them, no plan), and a new agent on that node
  rejoins;
- a restarted controller rebuilds its analysis from what the group had
  delivered, says nothing twice, and goes on;
- a plan reaches an agent's control file; a deposed leader's is refused;
- wrong credentials, a password on the command line, TLS without the CA:
  one line, and refused.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import corpus
from greyhound_bpf import GreyhoundError
from greyhound_bpf.analysis import AnalysisConfig, JobAnalysis
from greyhound_bpf.cluster.agent import Agent
from greyhound_bpf.cluster.connect import Refused, check, client, endpoint
from greyhound_bpf.cluster.controller import Controller, Lease
from greyhound_bpf.events import make_event
from greyhound_bpf.probe.catalog import load_catalog
from harness import JsonlTail, wait_for
from redisbed import RedisBed

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobc"
RECORDING = corpus.SCENARIOS / "compute-demo4-r2.rec.gz"
SPEED = 4.0             # the recording's pace: its 72 s in 18


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    with RedisBed(tmp_path_factory.mktemp("redis"), JOB, ["a", "b"]) as b:
        yield b


@pytest.fixture
def fresh(bed):
    """No streams, commands or lease of an earlier test."""
    r = bed.client("controller")
    for k in r.scan_iter(match=f"gh:{JOB}:*"):
        r.delete(k)
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def start_agent(bed, procs, node: str, ranks: str, recording=RECORDING):
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "agent_replay.py"), bed.url,
                          JOB, node, ranks, str(recording),
                          str(bed.secret_file(f"agent-{node}")), str(SPEED)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(p)
    return p


def make_controller(bed, consumer="c1", mitigate=False, epoch=1):
    events, said = [], []
    config = AnalysisConfig(validate=False, mitigate=mitigate)
    ctl = Controller(bed.client("controller"), JOB, JobAnalysis(load_catalog(), JOB, config),
                     events.append, said.append, consumer=consumer, epoch=epoch,
                     mitigate=mitigate)
    return ctl, events, said


def run_until(ctl, pred, timeout: float, what: str, said=None):
    def turn():
        ctl.step(block_ms=100)
        return pred()
    return wait_for(turn, timeout, what, interval=0,
                    why=lambda: "\n".join(said or []))


def kinds(events, kind):
    return [e for e in events if e["kind"] == kind]


def test_the_controller_names_the_slow_rank_and_its_node(bed, fresh):
    start_agent(bed, fresh, "a", "0,1")
    start_agent(bed, fresh, "b", "2,3")
    ctl, events, said = make_controller(bed)
    ctl.start()
    run_until(ctl, lambda: any(d.get("ranks") == [2] for d in kinds(events, "diagnosis")),
              90, "a verdict on rank 2", said)
    d = next(d for d in kinds(events, "diagnosis") if d.get("ranks") == [2])
    assert (d["cause"], d["evidence"], d["nodes"]) == ("computation", "passive", ["b"])
    # Every verdict the controller gave is about the slow rank.
    assert {tuple(x["ranks"]) for x in kinds(events, "diagnosis") if x.get("ranks")} == {(2,)}
    census = kinds(events, "census")[-1]
    assert census["complete"] and census["world"] == 4 and census["problems"] == []
    assert census["where"] == {0: ["a"], 1: ["a"], 2: ["b"], 3: ["b"]}
    assert {e["node"] for e in kinds(events, "agent")} == {"a", "b"}
    # Job-level iterations came from both nodes' ranks.
    assert {e["rank"] for e in kinds(events, "iteration")} == {0, 1, 2, 3}


def test_a_job_sparse_in_collectives_is_judged_call_by_call_across_nodes(bed, fresh):
    # fairseq's legacy trainer with rank 2 already slow at attach (the tune
    # split's preslow-fairseq3-r2): 6-7 s an update, two collectives each,
    # no rank's iterations found in its 50 s, so only the call-by-call look
    # names it; the controller is sent iterations, so the agents send it
    # the collectives too. It says what one analysis of the whole job says,
    # from its data as it comes.
    rec = corpus.SCENARIOS / "preslow-fairseq3-r2.rec.gz"
    one = next(e for e in corpus.replay("preslow-fairseq3-r2", validate=False)
               if e["kind"] == "diagnosis")
    start_agent(bed, fresh, "a", "0,1", rec)
    start_agent(bed, fresh, "b", "2", rec)
    ctl, events, said = make_controller(bed)
    ctl.start()
    run_until(ctl, lambda: kinds(events, "diagnosis"), 60, "a verdict", said)
    d = kinds(events, "diagnosis")[0]
    assert (d["cause"], d["evidence"], d["ranks"], d["nodes"]) == (
        "computation", "passive", [2], ["b"]), d
    # From the same window here; each agent's batches arrive as they come,
    # so a busy host may move the look by an update (5-7 s) at most.
    assert d["details"]["calls"], d
    assert abs(d["details"]["at_ns"] - one["details"]["at_ns"]) <= 8e9, (d, one)
    assert kinds(events, "iteration") == []


def test_iterations_sent_before_older_events_are_all_taken_once(bed, fresh):
    """An agent publishes a batch of iterations, then the events it saw
    before the batch left (an event's time is when it was seen). Read in one
    turn, every iteration reaches the analysis, once. (Told in the order of
    their times, such a batch looked taken already: a CI run lost 1.2 s of
    the slow rank's iterations, and the controller planned without them.)"""
    from greyhound_bpf.analysis import Iterations
    from greyhound_bpf.cluster.bus import AgentBus
    ctl, events, said = make_controller(bed)
    fed = []
    ctl.record = fed.append
    ctl.start()
    agent = AgentBus(bed.client("agent-a"), JOB, "a", "incarnation-1")
    t = time.time_ns()
    agent.hello(t, [{"pid": 7, "rank": 0, "local_rank": 0, "world_size": 1, "comm": "python"}])
    for first in (0, 20, 40):
        sent = t + (first + 20) * 10**7
        agent.iterations(sent, {7: [{"index": i, "start_ns": t + i * 10**7, "dur_ns": 10**7,
                                     "period_calls": 2, "comm_ns": 10**6, "compute_ns": 9 * 10**6}
                                    for i in range(first, first + 20)]})
        seen = sent - 5 * 10**7
        agent.publish("event", seen, event={"kind": "slowdown", "scope": "rank", "rank": 0,
                                            "time_ns": seen})

    def taken():
        return [i["index"] for inp in fed if isinstance(inp, Iterations) for i in inp.items]
    run_until(ctl, lambda: len(taken()) >= 60, 20, "60 iterations taken", said)
    for _ in range(5):
        ctl.step(block_ms=100)
    assert taken() == list(range(60))
    assert len(kinds(events, "node_event")) == 3


def test_a_killed_agent_is_lost_then_rejoins(bed, fresh):
    start_agent(bed, fresh, "a", "0,1")
    b = start_agent(bed, fresh, "b", "2,3")
    ctl, events, said = make_controller(bed)
    ctl.start()
    run_until(ctl, lambda: kinds(events, "census") and kinds(events, "census")[-1]["complete"]
              and len(kinds(events, "iteration")) > 400, 90, "both nodes' iterations", said)
    os.kill(b.pid, signal.SIGKILL)
    b.wait(10)
    t_kill = time.monotonic()
    run_until(ctl, lambda: kinds(events, "agent_lost"), 15, "agent_lost", said)
    lost = kinds(events, "agent_lost")[0]
    assert (lost["node"], lost["ranks"]) == ("b", [2, 3])
    assert 2.5 < time.monotonic() - t_kill < 8
    assert lost["silent_s"] >= 3.0
    assert not kinds(events, "agent_left")
    at = len(events)
    for _ in range(20):                 # the controller goes on without node b
        ctl.step(block_ms=100)
    ranks = ctl.analysis.ranks
    assert sorted(r.rank for r in ranks.values() if r.exited) == [2, 3]
    assert not [e for e in events[at:] if e["kind"] == "diagnosis"]
    assert kinds(events, "census")[-1]["complete"] is False
    # A new agent on node b: a new incarnation, its ranks announced again.
    start_agent(bed, fresh, "b", "2,3")
    run_until(ctl, lambda: [e for e in kinds(events, "agent") if e["node"] == "b"
                            and e["rejoined"]], 60, "node b rejoining", said)
    run_until(ctl, lambda: kinds(events, "census")[-1]["complete"], 30, "census again", said)
    run_until(ctl, lambda: sorted(r.rank for r in ranks.values() if not r.exited) == [0, 1, 2, 3],
              5, "ranks 2 and 3 back in the analysis", said)
    run_until(ctl, lambda: any(e["rank"] == 2 for e in kinds(events[at:], "iteration")), 30,
              "rank 2's iterations again", said)


def test_a_new_controller_rebuilds_from_the_group_and_says_nothing_twice(bed, fresh):
    start_agent(bed, fresh, "a", "0,1")
    start_agent(bed, fresh, "b", "2,3")
    first, events1, said1 = make_controller(bed, "c1")
    first.start()
    run_until(first, lambda: kinds(events1, "diagnosis"), 90, "a verdict", said1)
    # The second controller: another consumer; what the first took is history.
    second, events2, said2 = make_controller(bed, "c2")
    n = second.start()
    assert n >= 6                       # hellos, batches of iterations, heartbeats
    assert events2 == []                                # rebuilt, muted
    assert [(d.cause, d.ranks) for d in second.analysis.diagnoses] == \
        [(d.cause, d.ranks) for d in first.analysis.diagnoses]
    # (The first still holds its last fraction of a second, not yet fed.)
    assert second.analysis.job_iterations >= first.analysis.job_iterations > 300
    # The second goes on with what the first never read, to the end.
    run_until(second, lambda: all("fed" in p.stdout.readline() for p in fresh), 60,
              "the agents to have published the whole recording")
    for _ in range(20):
        second.step(block_ms=100)

    def said(evs):
        return [(e["cause"], e["ranks"], e["time_ns"]) for e in kinds(evs, "diagnosis")]
    # Between them they said each verdict once: what one controller
    # rebuilding from everything finds.
    third, events3, _ = make_controller(bed, "c3")
    third.start()
    assert events3 == []
    assert said(events1) + said(events2) == [
        (d.cause, list(d.ranks), d.details["at_ns"]) for d in third.analysis.diagnoses]
    assert said(events1) and said(events2)


@pytest.mark.parametrize("again_ms, slow", [(10.4, False), (16.5, True)])
def test_a_device_slow_on_one_pass_is_measured_again_beside_the_fastest(bed, fresh,
                                                                          again_ms, slow):
    """Node b has one device: its own validator has no witness to measure a
    suspect beside, so the controller looks again. Rank 2 reads x1.53 the
    reference once; it is measured again with rank 0 (the fastest) as a
    witness, and each keeps its better time: a busy moment (10.4 ms the
    second time) is healthy, a slow device (16.5) stays slow. Rank 1, slow
    too but measured twice by node a's validator already, is not asked for
    again, and stays slow."""
    from greyhound_bpf.analysis import Validated
    from greyhound_bpf.cluster.bus import AgentBus
    ctl, events, said = make_controller(bed)
    fed = []
    ctl.record = fed.append
    ctl.start()
    t = time.time_ns()
    a = AgentBus(bed.client("agent-a"), JOB, "a", "inc-a")
    b = AgentBus(bed.client("agent-b"), JOB, "b", "inc-b")
    a.hello(t, [{"pid": 7 + r, "rank": r, "local_rank": r, "world_size": 4, "comm": "python"}
                for r in (0, 1, 3)])
    b.hello(t, [{"pid": 7, "rank": 2, "local_rank": 0, "world_size": 4, "comm": "python"}])

    def until(pred, what):                  # the agents' heartbeats go on meanwhile
        def turn():
            for agent in (a, b):
                agent.heartbeat(time.time_ns())
            ctl.step(block_ms=100)
            return pred()
        return wait_for(turn, 20, what, interval=0, why=lambda: "\n".join(said))
    until(lambda: ctl.node_of_rank(2) == "b" and ctl.node_of_rank(0) == "a", "both hellos")
    r = bed.client("controller")

    def commands():
        return [(f[b"kind"].decode(), json.loads(f[b"data"]))
                for _, f in r.xrange(f"gh:{JOB}:cmd")]
    ctl._route(make_event("validation", JOB, time.time_ns(), phase="request", id=5,
                          devices=[0, 1, 2, 3], edges=[], reason="a test", suspects=[]))
    assert commands()[-1] == ("validate", {"id": 5, "devices": [0, 1, 2, 3], "edges": [],
                                           "reason": "a test", "suspects": []})

    def gemm(ms, passes=1):
        return {"ms_per_gemm": ms, "gemms": 50, "passes": passes}
    a.publish("validated", time.time_ns(), request=5, result={
        "devices": {"0": gemm(10.0, 2), "1": gemm(16.0, 2), "3": gemm(10.1)},
        "paused_s": 0.6, "pauses": 1, "seconds": 2.0})
    b.publish("validated", time.time_ns(), request=5, result={
        "devices": {"2": gemm(15.5)}, "paused_s": 0.5, "pauses": 1, "seconds": 1.5})
    until(lambda: commands()[-1][1]["id"] == -5, "a second look")
    assert commands()[-1][1]["devices"] == [0, 2] and commands()[-1][1]["suspects"] == [2]
    assert not [x for x in fed if isinstance(x, Validated)]        # it waits for the answers
    a.publish("validated", time.time_ns(), request=-5, result={
        "devices": {"0": gemm(10.3)}, "paused_s": 0.4, "pauses": 1, "seconds": 1.0})
    b.publish("validated", time.time_ns(), request=-5, result={
        "devices": {"2": gemm(again_ms)}, "paused_s": 0.4, "pauses": 1, "seconds": 1.0})
    until(lambda: [x for x in fed if isinstance(x, Validated)], "the merged measurements")
    got = next(x for x in fed if isinstance(x, Validated)).result
    assert {r: (d["ms_per_gemm"], d["passes"]) for r, d in got["devices"].items()} == {
        "0": (10.0, 3), "1": (16.0, 2), "2": (min(15.5, again_ms), 2), "3": (10.1, 1)}
    assert (got["paused_s"], got["pauses"]) == (0.6, 2)
    assert got["nodes"] == {"0": "a", "1": "a", "2": "b", "3": "a"}
    until(lambda: kinds(events, "diagnosis"), "the verdict")
    d = kinds(events, "diagnosis")[-1]
    assert (d["cause"], d["ranks"], d["nodes"]) == (
        ("computation", [1, 2], ["a", "b"]) if slow else ("computation", [1], ["a"])), d
    assert "measured again, with rank 0 (the fastest) as a witness" in "\n".join(said)


def test_a_plan_reaches_the_agents_control_file_and_a_deposed_leaders_does_not(bed, fresh,
                                                                              tmp_path):
    r = bed.client("controller")
    old, new = Lease(r, JOB, "old"), Lease(r, JOB, "new", ttl_ms=60_000)
    e1 = old.acquire()
    assert e1 is not None and new.acquire() is None
    old.release()
    e2 = new.acquire()
    assert e2 == e1 + 1 and new.renew() and not old.renew()
    ctl_file = tmp_path / "ctl.json"
    agent = Agent(endpoint(bed.url, "agent-a", bed.secret_file("agent-a")), JOB, "a",
                  str(ctl_file), say=print)
    try:
        def plan(epoch, seq, split):
            r.xadd(f"gh:{JOB}:cmd", {"kind": "plan", "epoch": epoch, "t": 1, "data": json.dumps(
                {"seq": seq, "strategy": "rebalance_microbatches",
                 "plan": {"microbatches": {"0": split[0], "1": split[1]}}, "reason": "test"})})
        time.sleep(0.6)                      # the agent reads from the newest command on
        plan(e2, 1, (5, 3))
        wait_for(lambda: ctl_file.exists(), 10, "plan 1 written")
        plan(e1, 2, (2, 6))                  # the deposed leader
        plan(e2, 3, (4, 4))
        wait_for(lambda: json.loads(ctl_file.read_text())["seq"] == 3, 10, "plan 3 written")
        doc = json.loads(ctl_file.read_text())
        assert doc["microbatches"] == {"0": 4, "1": 4}
    finally:
        agent.close()
    # The agent said it wrote 1 and 3, never 2.
    got = [json.loads(f[b"data"])["seq"] for _, f in r.xrange(f"gh:{JOB}:ev:a")
           if f[b"kind"] == b"plan_written"]
    assert got == [1, 3]


def test_refused_credentials_and_a_password_on_the_command_line(bed, fresh, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    ep = endpoint(bed.url, "agent-a", str(wrong))
    with pytest.raises(Refused, match="refused user 'agent-a'") as e:
        check(client(ep), ep)
    assert "\n" not in str(e.value)
    with pytest.raises(GreyhoundError, match="no password in the URL"):
        endpoint(f"redis://agent-a:{bed.passwords['agent-a']}@{bed.bind}:{bed.port}", "x")
    # The command: one line on stderr, exit 2, no traceback.
    env = {**os.environ, "GREYHOUND_REDIS_PASSWORD": "nope"}
    p = subprocess.run([sys.executable, "-m", "greyhound_bpf.cli", "controller", "--cluster",
                        bed.url, "--job", JOB, "--duration", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "refused user 'controller'" in p.stderr
    # An agent may not write another node's stream, nor read the events.
    import redis
    with pytest.raises(redis.exceptions.NoPermissionError):
        bed.client("agent-a").xadd(f"gh:{JOB}:ev:b", {"kind": "x"})


def test_tls_needs_the_ca(tmp_path):
    with RedisBed(tmp_path, JOB, ["a"], tls=True) as tls:
        secret = str(tls.secret_file("agent-a"))
        ok = endpoint(tls.url, "agent-a", secret, ca=str(tls.certs["ca.pem"]))
        check(client(ok), ok)
        with_cert = endpoint(tls.url, "agent-a", secret, ca=str(tls.certs["ca.pem"]),
                             cert=str(tls.certs["client.pem"]),
                             key=str(tls.certs["client.key"]))
        check(client(with_cert), with_cert)
        no_ca = endpoint(tls.url, "agent-a", secret)
        with pytest.raises(Refused, match="TLS failed") as e:
            check(client(no_ca), no_ca)
        assert "\n" not in str(e.value)
        plain = endpoint(tls.url.replace("rediss", "redis"), "agent-a", secret)
        with pytest.raises(GreyhoundError):
            check(client(plain), plain)


def test_a_standby_takes_over_from_a_killed_leader_with_no_duplicate_plan(bed, fresh,
                                                                         tmp_path):
    def controller(name):
        out = open(tmp_path / f"{name}.out", "w+")
        p = subprocess.Popen(
            [sys.executable, "-m", "greyhound_bpf.cli", "controller", "--cluster", bed.url,
             "--job", JOB, "--cluster-secret", str(bed.secret_file("controller")),
             "--mitigate", "--microbatches", "16", "--no-validate",    # (replays: no workers)
             "-o", str(tmp_path / f"{name}.jsonl")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        fresh.append(p)
        return p, out

    def said(out):
        out.flush()
        out.seek(0)
        return out.read()

    def plans():
        r = bed.client("controller")
        return [(int(f[b"epoch"]), json.loads(f[b"data"])["seq"])
                for _, f in r.xrange(f"gh:{JOB}:cmd") if f[b"kind"] == b"plan"]

    leader, leader_out = controller("leader")
    wait_for(lambda: "leading job" in said(leader_out), 30, "the first to lead")
    standby, standby_out = controller("standby")
    wait_for(lambda: "standby:" in said(standby_out), 30, "the second to wait")
    start_agent(bed, fresh, "a", "0,1")
    start_agent(bed, fresh, "b", "2,3")
    wait_for(plans, 90, "the leader's first plan", interval=0.2,
             why=lambda: said(leader_out))
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait(10)
    wait_for(lambda: "leading job" in said(standby_out), 20, "the standby to take over",
             why=lambda: said(standby_out))
    assert "(epoch 2)" in said(standby_out) and "rebuilt from" in said(standby_out)
    time.sleep(8)                                       # the rest of the recording
    got = plans()
    assert got[0] == (1, 1), got
    seqs = [s for _, s in got]
    assert seqs == sorted(set(seqs)), got               # no plan number twice
    assert all(e == 2 for e, s in got[1:]), got          # later ones are the new leader's
    # What the standby wrote says nothing the leader had said.
    events = [json.loads(x) for x in (tmp_path / "standby.jsonl").read_text().splitlines()]
    lead = [json.loads(x) for x in (tmp_path / "leader.jsonl").read_text().splitlines()]
    key = lambda e: (e["kind"], e["time_ns"], e.get("seq"))  # noqa: E731
    assert not {key(e) for e in events if e["kind"] in ("diagnosis", "action")} & \
        {key(e) for e in lead if e["kind"] in ("diagnosis", "action")}
    standby.send_signal(signal.SIGINT)
    assert standby.wait(15) == 0


@pytest.mark.parametrize("args, code, message", [
    (["attach", "1", "--node", "a"], 2, "--node goes with --cluster URL"),
    (["attach", "1", "--cluster", "redis://127.0.0.1:1"], 2, "--cluster needs --node NAME"),
    (["attach", "1", "--cluster", "redis://u:pw@127.0.0.1:1", "--node", "a", "--job", "j"], 2,
     "no password in the URL"),
    (["attach", "1", "--cluster", "redis://127.0.0.1:1", "--node", "a b", "--job", "j"], 2,
     "--node 'a b': use letters"),
    (["attach", "1", "--cluster", "http://127.0.0.1:1", "--node", "a", "--job", "j"], 2,
     "give redis://HOST:PORT"),
    # The controller's options, given to an agent, would do nothing there.
    (["attach", "1", "--cluster", "redis://127.0.0.1:1", "--node", "a", "--job", "j",
      "--mitigate", "--control-file", "/tmp/x.json"], 2,
     "--mitigate: with --cluster the controller validates and plans"),
    (["attach", "1", "--cluster", "redis://127.0.0.1:1", "--node", "a", "--job", "j",
      "--pause-budget", "0.05", "--no-validate"], 2,
     "--no-validate, --pause-budget: with --cluster the controller"),
    (["controller", "--cluster", "redis://127.0.0.1:1"], 2, "needs --cluster URL and --job"),
    (["controller", "--cluster", "redis://127.0.0.1:1", "--job", "j"], 1, "cannot be reached"),
    (["controller", "--cluster", "redis://127.0.0.1:1", "--job", "j", "--cluster-ca", "x.pem"],
     2, "are for TLS: use rediss://"),
])
def test_bad_cluster_arguments_are_one_line(args, code, message):
    p = subprocess.run([sys.executable, "-m", "greyhound_bpf.cli", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GREYHOUND_REDIS_PASSWORD": "x"})
    assert p.returncode == code, p.stderr
    assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


def test_redis_restarted_without_its_data_the_controller_and_agents_go_on(tmp_path):
    """Redis goes away and comes back empty (no persistence): the agents
    trace locally meanwhile and reconnect; the controller says what was lost
    (a `gap`), makes its consumer group again, takes the vanished lease in
    a new epoch, and goes on reading the agents."""
    with RedisBed(tmp_path, JOB, ["a", "b"]) as bed2:
        procs, outs = [], {}
        try:
            for node, ranks in (("a", "0,1"), ("b", "2,3")):
                outs[node] = tmp_path / f"agent-{node}.out"
                procs.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "tests" / "agent_replay.py"), bed2.url, JOB,
                     node, ranks, str(RECORDING), str(bed2.secret_file(f"agent-{node}")),
                     "1.0"], cwd=ROOT, stdout=open(outs[node], "w"), stderr=subprocess.STDOUT))
            events = tmp_path / "ctl.jsonl"
            ctl_out = open(tmp_path / "ctl.out", "w+")
            ctl = subprocess.Popen(
                [sys.executable, "-m", "greyhound_bpf.cli", "controller", "--cluster", bed2.url,
                 "--job", JOB, "--cluster-secret", str(bed2.secret_file("controller")),
                 "--no-validate", "--iterations", "-o", str(events)],
                cwd=ROOT, stdout=ctl_out, stderr=subprocess.STDOUT, text=True)
            procs.append(ctl)
            tail = JsonlTail(events)
            wait_for(lambda: [e for e in tail.read() if e["kind"] == "census"
                              and e["complete"]], 60, "every rank announced")
            wait_for(lambda: len([e for e in tail.read() if e["kind"] == "iteration"]) > 100,
                     60, "iterations")
            bed2.stop()
            time.sleep(15)                   # (longer than the client's own retries)
            bed2.start()
            gap = wait_for(lambda: [e for e in tail.read() if e["kind"] == "gap"], 60,
                           "the controller's gap", why=lambda: (tmp_path / "ctl.out").read_text())
            assert "redis lost the streams" in gap[0]["reason"]
            at = len(tail.read())
            wait_for(lambda: {e["rank"] for e in tail.read()[at:] if e["kind"] == "iteration"}
                     == {0, 1, 2, 3}, 60, "every rank's iterations again",
                     why=lambda: (tmp_path / "ctl.out").read_text())
            said = (tmp_path / "ctl.out").read_text()
            assert "leading again as epoch 2" in said and ctl.poll() is None, said
            assert not [e for e in tail.read() if e["kind"] == "agent_lost"], said
            for node in "ab":
                text = outs[node].read_text()
                assert "tracing locally" in text and "is back after" in text, text
            last = [e for e in tail.read() if e["kind"] == "iteration"][-1]
            assert last["producer"].endswith(":2"), last
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


def test_a_controller_started_with_sigint_ignored_still_stops_on_it(bed, fresh, tmp_path):
    """A non-interactive shell starts background jobs (`greyhound-trace
    controller ... &` in a script) with SIGINT ignored, and Python keeps an
    inherited SIG_IGN: such a controller ignored `kill -INT` (a CI run that
    started the suite that way timed out waiting for the standby to stop).
    Every command takes SIGINT as Ctrl-C, whatever it inherited."""
    out = open(tmp_path / "ctl.out", "w+")
    p = subprocess.Popen(
        [sys.executable, "-m", "greyhound_bpf.cli", "controller", "--cluster", bed.url,
         "--job", JOB, "--cluster-secret", str(bed.secret_file("controller")), "--no-validate"],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    fresh.append(p)

    def said():
        out.flush()
        out.seek(0)
        return out.read()
    wait_for(lambda: "leading job" in said(), 30, "the controller to lead", why=said)
    p.send_signal(signal.SIGINT)
    assert p.wait(15) == 0, said()
    assert "stopped:" in said()
