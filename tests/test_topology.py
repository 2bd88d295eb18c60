"""The communicator map from probe records: NCCL inits, splits and p2p
peers across processes, gloo groups from the call pattern; and the
`topology` event of a real 4-rank gloo DDP job."""
import numpy as np
import pytest

from conftest import wait_for
from greyhound_bpf.probe.catalog import FIELD_SLOT0, load_catalog
from greyhound_bpf.probe.records import CALL_DTYPE
from greyhound_bpf.engine.topology import GLOO_PATTERN_CALLS, Topology

CAT = load_catalog()


def rec(pid, fn, ret=0, **args):
    spec = CAT.by_name[fn]
    r = np.zeros(1, dtype=CALL_DTYPE)
    r["pid"], r["fn"], r["ret"] = pid, spec.fid, ret
    for name, v in args.items():
        if name in spec.args:
            r["args"][0, spec.args.index(name)] = v & (2**64 - 1)
        else:
            names = [f for f, _ in spec.fields]
            r["args"][0, FIELD_SLOT0 + names.index(name)] = v
    return r


def feed(topo, recs, ranks):
    topo.feed(np.concatenate(recs), ranks)


def test_world_and_tensor_parallel_pairs_and_a_pipeline_edge():
    t = Topology(CAT)
    ranks = {100 + r: r for r in range(4)}
    recs = []
    for r in range(4):
        pid = 100 + r
        recs.append(rec(pid, "ncclCommInitRank", comm=0x1000 + pid, nranks=4, comm_rank=r))
        # tensor-parallel pairs {0,1} and {2,3}, made by a second init of size 2
        recs.append(rec(pid, "ncclCommInitRank", comm=0x2000 + pid, nranks=2, comm_rank=r % 2))
    # pipeline: rank 1 sends to its world peer 3, which receives from 1
    recs.append(rec(101, "ncclSend", comm=0x1000 + 101, peer=3, count=10))
    recs.append(rec(103, "ncclRecv", comm=0x1000 + 103, peer=1, count=10))
    feed(t, recs, ranks)
    f = t.changed()
    comms = {tuple(c["ranks"]): c for c in f["communicators"]}
    assert set(comms) == {(0, 1, 2, 3), (0, 1), (2, 3)}
    assert comms[(0, 1, 2, 3)]["nranks"] == 4 and comms[(0, 1)]["nranks"] == 2
    assert all(c["backend"] == "nccl" and c["state"] == "ok" for c in comms.values())
    assert f["p2p_edges"] == [[1, 3]]
    assert t.changed() is None                       # nothing new
    assert t.communicator_of([2, 3])["ranks"] == [2, 3]
    assert t.communicator_of([1, 2])["ranks"] == [0, 1, 2, 3]


def test_split_by_colour_ordered_by_key():
    t = Topology(CAT)
    ranks = {200 + r: r for r in range(4)}
    recs = [rec(200 + r, "ncclCommInitRank", comm=0x10 + r, nranks=4, comm_rank=r)
            for r in range(4)]
    # colour = rank % 2, key = -rank: {2, 0} and {3, 1} in that order
    recs += [rec(200 + r, "ncclCommSplit", parent=0x10 + r, color=r % 2, key=10 - r,
                 comm=0x90 + r) for r in range(4)]
    feed(t, recs, ranks)
    f = t.fields()
    world = next(c for c in f["communicators"] if c["source"] == "init")
    splits = sorted((c for c in f["communicators"] if c["source"] == "split"),
                    key=lambda c: c["ranks"])
    assert [c["ranks"] for c in splits] == [[2, 0], [3, 1]]
    assert all(c["parent"] == world["name"] for c in splits)


def test_failed_init_is_listed_as_failed():
    t = Topology(CAT)
    feed(t, [rec(300, "ncclCommInitRank", ret=4, comm=0, nranks=2, comm_rank=0),
             rec(301, "ncclCommInitRank", ret=0, comm=0x55, nranks=2, comm_rank=1)],
         {300: 0, 301: 1})
    (c,) = t.fields()["communicators"]
    assert c["ranks"] == [0, 1] and c["state"] == "failed" and c["failed"] == {"0": 4}


def test_gloo_groups_come_from_the_call_pattern():
    t = Topology(CAT)
    recs = []
    for r in range(4):
        # ranks 0-3 all-reduce the same two buckets; 2 and 3 also broadcast
        for i in range(GLOO_PATTERN_CALLS):
            recs.append(rec(400 + r, "gloo::allreduce", count=1000 + i % 2, elem_size=4))
        if r >= 2:
            recs.append(rec(400 + r, "gloo::broadcast"))
    feed(t, recs, {400 + r: r for r in range(4)})
    gl = [c for c in t.fields()["communicators"] if c["backend"] == "gloo"]
    assert sorted(c["ranks"] for c in gl) == [[0, 1], [2, 3]]
    assert all(c["source"] == "call pattern" for c in gl)


def test_too_few_calls_is_no_group_yet():
    t = Topology(CAT)
    feed(t, [rec(500, "gloo::allreduce", count=5, elem_size=4)], {500: 0})
    assert t.changed() is None


def _job_records(ranks):
    """World init of 4, tensor-parallel pairs (a second init of size 2), a
    split by colour of the world, and a pipeline edge 1 -> 3."""
    recs = []
    for r in ranks:
        pid = 600 + r
        recs.append(rec(pid, "ncclCommInitRank", comm=0x1000 + pid, nranks=4, comm_rank=r))
        recs.append(rec(pid, "ncclCommInitRank", comm=0x2000 + pid, nranks=2, comm_rank=r % 2))
        recs.append(rec(pid, "ncclCommSplit", parent=0x1000 + pid, color=r % 2, key=10 - r,
                        comm=0x3000 + pid))
        if r == 1:
            recs.append(rec(pid, "ncclSend", comm=0x1000 + pid, peer=3, count=10))
        if r == 3:
            recs.append(rec(pid, "ncclRecv", comm=0x1000 + pid, peer=1, count=10))
        for i in range(GLOO_PATTERN_CALLS):
            recs.append(rec(pid, "gloo::allreduce", count=1000 + i % 2, elem_size=4))
    return recs


def _shape(f):
    by_name = {c["name"]: c for c in f["communicators"]}
    return ({(c["backend"], tuple(c["ranks"]), c["nranks"], c["source"],
              tuple(by_name[c["parent"]]["ranks"]) if c["parent"] else None)
             for c in f["communicators"]}, f["p2p_edges"])


def test_nodes_maps_merge_into_the_one_machines_map():
    """Two nodes (ranks 0-1 and 2-3) each see only their ranks' calls; the
    controller's merge of their maps is the map one machine seeing all four
    would make: the world and the split's groups across nodes, the tensor-
    parallel pairs (one key, a pair per node) kept apart, the pipeline edge."""
    one = Topology(CAT)
    feed(one, _job_records(range(4)), {600 + r: r for r in range(4)})
    job = Topology(CAT)
    for node, ranks in (("a", (0, 1)), ("b", (2, 3))):
        t = Topology(CAT)
        feed(t, _job_records(ranks), {600 + r: r for r in ranks})
        job.merge(node, t.changed())
    assert _shape(job.fields()) == _shape(one.fields())
    comms = {tuple(c["ranks"]) for c in job.fields()["communicators"]}
    assert {(0, 1, 2, 3), (0, 1), (2, 3), (2, 0), (3, 1)} <= comms
    assert job.communicator_of([1, 2])["ranks"] == [0, 1, 2, 3]
    # A node's newer map replaces its older one.
    job.merge("b", {"communicators": [], "p2p_edges": []})
    assert {tuple(c["ranks"]) for c in job.fields()["communicators"]
            if c["backend"] == "nccl"} == {(0, 1), (0,), (1,)}


@pytest.mark.bpf
@pytest.mark.slow
def test_topology_event_of_a_live_gloo_job(ddp_job, tracer):
    job = ddp_job(4, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 4, 120, "the job to train")
    t = tracer([job.proc.pid], "-q", "--no-validate")
    t.wait_attached(4)
    ev = wait_for(lambda: t.events("topology"), 60, "a topology event", interval=0.5)[-1]
    gl = [c for c in ev["communicators"] if c["backend"] == "gloo"]
    assert [c["ranks"] for c in gl] == [[0, 1, 2, 3]], ev
    assert ev["p2p_edges"] == []
    assert "TOPOLOGY gloo:0 ranks 0-3" in t.output() or "gloo:0" in t.output()
