"""Agents and the controller over a real Redis (Debian's redis-server,
started here with its own config: the `default` user off, one ACL user per
agent that may only append to its own node's stream, one for the
controller). Issue #14's transport and its security, tried for real:
- an agent writing another node's stream is refused (NOPERM), a client
  without credentials or with a wrong password too;
- a recorded real job's iterations, published by two agents (ranks 0-1 on
  node a, 2-3 on node b) and read through the consumer group, give the
  controller's JobAnalysis the verdicts the local analysis gave;
- a controller that restarts before acknowledging gets the pending
  messages again, and duplicates are dropped."""
import time

import pytest
import redis

import corpus
from greyhound_bpf.analysis import Calls, JobAnalysis, Targets
from greyhound_bpf.cluster.bus import AgentBus, ControllerBus, JobInputs
from greyhound_bpf.probe.catalog import load_catalog
from greyhound_bpf.recording import Recording
from redisbed import RedisBed

JOB = "job1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisBed(tmp_path_factory.mktemp("redis"), JOB, ["a", "b"]) as bed:
        yield bed


def client(bed, user, password=None):
    return bed.client(user, password)


def test_each_agent_writes_only_its_own_stream(server):
    a = AgentBus(client(server, "agent-a"), JOB, "a", "inc1")
    assert a.heartbeat(1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        AgentBus(client(server, "agent-a"), JOB, "b", "inc1").heartbeat(1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client(server, "agent-a").xrange(f"gh:{JOB}:ev:a")          # nor read
    with pytest.raises(redis.exceptions.AuthenticationError):
        client(server, "agent-a", "wrong").ping()
    with pytest.raises(redis.exceptions.AuthenticationError, match="authenticated"):
        redis.Redis(host=server.bind, port=server.port).ping()                            # `default` is off


def test_a_job_split_over_two_agents_gets_the_local_verdicts(server):
    cat = load_catalog()
    rec = Recording(str(corpus.SCENARIOS / "compute-demo4-r2.rec.gz"), cat)
    local = JobAnalysis(cat, rec.job, rec.config)
    node_of = {0: "a", 1: "a", 2: "b", 3: "b"}
    job = f"{JOB}"
    agents = {n: AgentBus(client(server, f"agent-{n}"), job, n, f"inc-{time.time_ns()}")
              for n in "ab"}
    ctl = ControllerBus(client(server, "controller"), job, ["a", "b"])
    want, other = [], []               # the local events; inputs the controller gets itself
    for i, inp in enumerate(rec.inputs()):
        out = local.feed(inp)
        want += out
        if isinstance(inp, Targets):
            for n in "ab":
                mine = [d for d in inp.added if node_of.get(d.get("rank")) == n]
                if mine:
                    agents[n].hello(inp.t_ns, mine, inp.begin_ns)
        elif isinstance(inp, Calls):
            pid_of = {r: p for p, r in local.rank_of().items()}
            for n in "ab":
                mine = {pid_of[r]: items for r, items in corpus.iterations_by_rank(out).items()
                        if node_of[r] == n}
                if mine:
                    agents[n].iterations(inp.t_ns, mine)
        else:
            other.append((inp.t_ns, i, inp))
    msgs = []
    while True:
        got = ctl.read(block_ms=200)
        if not got:
            break
        msgs += got
        ctl.ack(got)
    assert {m.node for m in msgs} == {"a", "b"}
    inputs = JobInputs()
    # The controller's order: by time, a node's messages in its order.
    bus = [(m.t_ns, -1, inp) for m in sorted(msgs, key=lambda m: (m.t_ns, m.node, m.seq))
           for inp in inputs.inputs(m)]
    controller = JobAnalysis(cat, job, rec.config)
    got = []
    for _, _, inp in sorted(bus + other, key=lambda x: (x[0], x[1])):
        got += controller.feed(inp)

    def verdicts(evs):
        return [(e["kind"], e.get("cause"), e.get("ranks"), e.get("evidence"), e["time_ns"])
                for e in evs if e["kind"] in ("slowdown", "diagnosis", "action")]
    # Ranks are the job's ranks whichever node announced them.
    assert verdicts(got) == verdicts(want)
    assert any(v[0] == "diagnosis" and v[1] == "computation" and v[2] == [2]
               for v in verdicts(got))
    pid2 = {r: p for p, r in local.rank_of().items()}[2]
    assert inputs.node_of[inputs.keys[("b", pid2)]] == "b"
    assert controller.rank_of()[inputs.keys[("b", pid2)]] == 2


def test_a_restarted_controller_gets_the_pending_again_and_drops_duplicates(server):
    job = "job1"
    a = AgentBus(client(server, "agent-a"), job, "a", f"inc-{time.time_ns()}")
    first = ControllerBus(client(server, "controller"), job, ["a"], consumer="c1")
    while older := first.read(block_ms=50):         # this module's earlier messages
        first.ack(older)
    a.hello(1, [{"pid": 11, "rank": 0, "world_size": 1}])
    a.iterations(2, {11: [{k: 1 for k in corpus.ITERATION_FIELDS}]})
    taken = first.read(block_ms=200)
    assert [m.kind for m in taken] == ["hello", "iterations"]
    inputs = JobInputs()
    assert [type(x).__name__ for m in taken for x in inputs.inputs(m)] == ["Targets", "Iterations"]
    # Not acknowledged; a new controller claims them and sees the same messages.
    second = ControllerBus(client(server, "controller"), job, ["a"], consumer="c2")
    _, claimed, _ = second.r.xautoclaim(f"gh:{job}:ev:a", "greyhound-controller", "c2", 0)
    assert len(claimed) == 2
    assert [x for m in taken for x in inputs.inputs(m)] == []      # already taken: dropped
