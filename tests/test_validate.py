"""Validation benchmarks (greyhound_bpf.diagnosis): the round schedule and the
decision rule on fixed numbers, then real workers: a pre-check on this host,
a CPU-quota straggler and a tbf-limited link in a running gloo job, each
named by measurement; nothing is left running and the job goes on."""
import subprocess
import time

import pytest

from conftest import read_events, run_cli, wait_for
from harness import unconfirmed_slowdowns
from greyhound_bpf.probe.discovery import all_stats
from greyhound_bpf.inject import CpuQuota, LinkRate
from greyhound_bpf.diagnosis.rules import Result, keep_better, ring_edges, schedule
from greyhound_bpf.diagnosis.rules import decide as verdict


def decide(res):
    """The `diagnosis` event's fields of a verdict."""
    return verdict(res).fields()
from netbed import NetBed


# -- rounds ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,rounds", [(2, 1), (3, 3), (4, 2), (5, 3), (8, 2), (9, 3)])
def test_ring_rounds_are_disjoint_and_cover_every_edge(n, rounds):
    edges = ring_edges(list(range(n)))
    got = schedule(edges)
    assert len(got) == rounds
    flat = [e for rnd in got for e in rnd]
    assert sorted(flat) == sorted((min(a, b), max(a, b)) for a, b in edges)
    for rnd in got:
        ends = [r for e in rnd for r in e]
        assert len(ends) == len(set(ends)), rnd


def test_pipeline_edges_join_the_ring_schedule():
    got = schedule(ring_edges([0, 1, 2, 3]) + [(0, 2), (2, 0), (1, 3)])
    flat = [e for rnd in got for e in rnd]
    assert len(flat) == len(set(flat)) == 6           # each once, duplicates merged
    assert len(got) == 3


# -- decision -----------------------------------------------------------------------

def result(gemm, rtt):
    return Result(devices={r: {"ms_per_gemm": v, "gflops": 1.0} for r, v in gemm.items()},
                  links={e: {"rtt_ms": v, "gbps": 1.0, "lat_us": 50.0}
                         for e, v in rtt.items()})


RING4 = {(0, 1): 3.0, (1, 2): 3.1, (2, 3): 2.9, (0, 3): 3.2}


def test_slow_device_is_named():
    d = decide(result({0: 3.0, 1: 3.1, 2: 6.2, 3: 2.9}, RING4))
    assert (d["cause"], d["ranks"], d["link"]) == ("computation", [2], None)
    assert d["evidence"] == "validation" and "rank 2 x2" in d["reason"]


def test_two_devices_the_faster_is_the_reference():
    d = decide(result({0: 3.0, 1: 5.0}, {(0, 1): 3.0}))
    assert (d["cause"], d["ranks"]) == ("computation", [1])


def test_a_rank_whose_every_edge_is_slow_has_the_slow_link():
    rtt = {**RING4, (0, 1): 60.0, (1, 2): 58.0}
    d = decide(result({r: 3.0 for r in range(4)}, rtt))
    assert (d["cause"], d["ranks"], d["link"]) == ("communication", [1], "rank 1")


def test_one_slow_edge_is_named_as_an_edge():
    rtt = {(0, 1): 3.0, (1, 2): 3.1, (2, 3): 12.0, (3, 4): 3.0, (0, 4): 2.9}
    d = decide(result({r: 3.0 for r in range(5)}, rtt))
    assert (d["cause"], d["link"]) == ("communication", "2<->3")


# Three nodes of two ranks, ring order: 0-1 and 4-5 inside n0 and n2, 2-3
# inside n1; 1-2, 3-4 and 0-5 between nodes.
NODES = {0: "n0", 1: "n0", 2: "n1", 3: "n1", 4: "n2", 5: "n2"}
RING6 = {(0, 1): 3.0, (1, 2): 3.1, (2, 3): 2.9, (3, 4): 3.2, (4, 5): 3.0, (0, 5): 3.1}


def test_a_node_whose_every_edge_to_the_others_is_slow_has_the_slow_link():
    res = result({r: 3.0 for r in range(6)}, {**RING6, (1, 2): 60.0, (3, 4): 55.0})
    res.nodes = NODES
    d = decide(Result.from_dict(res.to_dict()))       # (the map survives a recording)
    assert (d["cause"], d["ranks"], d["link"]) == ("communication", [2, 3], "node n1")
    assert "every edge between node n1 and the other nodes" in d["reason"]
    # Without the map: every rank has a fast edge inside its node, so only
    # the two edges are named.
    res.nodes = {}
    d = decide(res)
    assert (d["cause"], d["link"]) == ("communication", "1<->2, 3<->4")


def test_edges_between_nodes_are_judged_against_their_own_kind():
    """Two nodes of two ranks: the edges between them (a NIC) are 3x the
    edges inside them (loopback, NVLink) by nature, which is no fault; a
    slow device is still named alone. And with two nodes, both edges
    between them slow cannot say whose link it is (nothing to compare)."""
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    res = result({0: 3.0, 1: 3.0, 2: 9.0, 3: 3.1},
                 {(0, 1): 3.0, (1, 2): 9.0, (2, 3): 2.9, (0, 3): 9.3})
    res.nodes = nodes
    d = decide(res)
    assert (d["cause"], d["ranks"], d["link"]) == ("computation", [2], None), d["reason"]
    res.nodes = {}                                   # (one machine's rules: links slow too)
    assert decide(res)["cause"] == "unknown"
    res = result({r: 3.0 for r in range(4)}, {(0, 1): 3.0, (1, 2): 60.0, (2, 3): 2.9,
                                              (0, 3): 58.0})
    res.nodes = nodes
    d = decide(res)
    assert (d["cause"], d["link"]) == ("unknown", None), d["reason"]


def test_one_slow_edge_inside_a_node_is_not_two_slow_links():
    """Two nodes of two ranks, a slow device on n1 while n0's one edge
    inside it reads 2.15x n1's (a busy host's CPU, seen in CI): ranks 0 and 1
    have no edge but each other, so that is one slow edge (under the edge
    rule's 3x), not their two links, and the device is named alone."""
    res = result({0: 3.9, 1: 3.7, 2: 72.6, 3: 4.5},
                 {(0, 1): 7.43, (0, 3): 8.27, (1, 2): 7.72, (2, 3): 3.45})
    res.nodes = {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    d = decide(res)
    assert (d["cause"], d["ranks"], d["link"]) == ("computation", [2], None), d["reason"]
    # A rank with an edge to a fast rank is still its link's evidence.
    rtt = {**RING4, (0, 1): 60.0, (1, 2): 58.0}
    assert decide(result({r: 3.0 for r in range(4)}, rtt))["link"] == "rank 1"


def test_healthy_noise_is_unknown():
    d = decide(result({0: 3.0, 1: 3.6, 2: 3.3, 3: 2.8},
                      {(0, 1): 3.0, (1, 2): 4.0, (2, 3): 3.5, (0, 3): 2.9}))
    assert d["cause"] == "unknown" and d["ranks"] == [] and d["link"] is None
    assert "no slow device or link among 4 device(s) and 4 link(s)" in d["reason"]


def test_device_and_link_both_slow_is_not_a_guess():
    rtt = {**RING4, (0, 1): 60.0, (1, 2): 58.0}
    d = decide(result({0: 3.0, 1: 3.0, 2: 3.0, 3: 9.0}, rtt))
    assert d["cause"] == "unknown" and d["ranks"] == [1, 3]
    assert "both a device and a link" in d["reason"]


def _timed(rtts_ms: list[float]) -> dict:
    """`time_link` (the lower rank's end) over these round trips, in order."""
    from greyhound_bpf.diagnosis.worker import LATENCY_REPS, time_link
    # The connection's set-up, the latency round trips, then these.
    times = iter([1e-5] * (1 + LATENCY_REPS) + [x / 1e3 for x in rtts_ms])
    left = [len(rtts_ms)]

    def tell(more):
        left[0] -= 1
        return left[0] >= 0
    return time_link(lambda buf: next(times), tell, b"", b"", 4 << 20, True, 0.0)


def test_one_lucky_round_trip_is_not_the_reference():
    """The three-node live test's second phase, a CPU quota on node n2's
    rank (a clean-clone CI run): edge 0<->1's fastest round trip of 47 read
    1.10 ms (its median 4.09), n2's two edges' 3.06 and 3.37 (medians 4.36,
    5.28), and node n2 read as a slow link x2.79 beside its slow device: "both
    a device and a link", unknown. Judged by the 10th percentile of each
    edge's round trips, n2's link is healthy and the device named; a rate
    limit (every round trip slow, 3 of them) still names its node."""
    import random
    rnd = random.Random(7)

    def edge(lo, hi, n=45, lucky=None):
        xs = [rnd.uniform(lo, hi) for _ in range(n)]
        return _timed(xs[:20] + [lucky] + xs[20:] if lucky else xs)
    links = {(0, 1): edge(3.0, 5.5, lucky=1.10), (0, 2): edge(3.1, 5.6), (1, 2): edge(3.4, 6.5)}
    assert links[(0, 1)]["rtt_min_ms"] == 1.10 and links[(0, 1)]["rtt_ms"] > 2.9
    assert all(x["round_trips"] >= 45 for x in links.values())
    gemm = {0: 1.79, 1: 1.82, 2: 11.74}
    res = result(gemm, {e: d["rtt_ms"] for e, d in links.items()})
    res.nodes = {0: "n0", 1: "n1", 2: "n2"}
    d = decide(res)
    assert (d["cause"], d["ranks"], d["link"]) == ("computation", [2], None), d["reason"]
    # The single fastest, as before: the run's verdict.
    res.links = {e: {**x, "rtt_ms": x["rtt_min_ms"]} for e, x in links.items()}
    assert decide(res)["cause"] == "unknown"
    # 200mbit on n1: three round trips of ~177 ms on each of its edges.
    limited = {(0, 1): _timed([178.1, 177.8, 178.4]), (0, 2): edge(2.9, 4.8),
               (1, 2): _timed([176.9, 176.4, 177.0])}
    res = result({0: 1.9, 1: 1.9, 2: 1.75}, {e: x["rtt_ms"] for e, x in limited.items()})
    res.nodes = {0: "n0", 1: "n1", 2: "n2"}
    d = decide(res)
    assert (d["cause"], d["link"], d["ranks"]) == ("communication", "node n1", [1]), d


def test_a_second_look_keeps_the_better_time_and_counts_only_real_passes():
    first = {"ms_per_gemm": 30.0, "passes": 1}
    # a busy moment on the first pass: the second, faster, is kept
    assert keep_better(first, {"ms_per_gemm": 10.0}, "ms_per_gemm") == {
        "ms_per_gemm": 10.0, "passes": 2}
    # slow both times: the first (better) is kept, measured twice
    got = keep_better({"rtt_ms": 2.0, "passes": 2}, {"rtt_ms": 5.0}, "rtt_ms")
    assert got == {"rtt_ms": 2.0, "passes": 3}
    # a failed second look is not a pass: it cannot skip the confirming pause
    assert keep_better(first, None, "ms_per_gemm") == first
    assert keep_better(None, {"ms_per_gemm": 9.0}, "ms_per_gemm")["passes"] == 1


def test_nothing_measured_says_what_was_not_tested():
    r = Result(untested=["rank 0: worker exited (1): boom"])
    d = decide(r)
    assert d["cause"] == "unknown" and "rank 0: worker exited (1): boom" in d["reason"]


# -- real workers ---------------------------------------------------------------------

def workers_left() -> list[str]:
    return [s.comm for s in all_stats().values()
            if "diagnosis/worker.py" in " ".join(_cmdline(s.pid))]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.mark.slow
def test_precheck_table_and_event(tmp_path):
    out = tmp_path / "v.jsonl"
    r = run_cli("validate", "--world", "4", "-o", str(out), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr          # a healthy host: nothing slow
    for what in ("devices (GEMM)", "links (p2p", "0<->1", "1<->2", "2<->3", "0<->3",
                 "verdict: unknown"):
        assert what in r.stdout, r.stdout
    assert "p2p round 1/2: 0<->1, 2<->3" in r.stderr and "p2p round 2/2" in r.stderr
    (ev,) = read_events(out)
    assert ev["kind"] == "diagnosis" and ev["evidence"] == "validation"
    assert set(ev["details"]["devices"]) == {"0", "1", "2", "3"}
    assert all(d["gflops"] > 0.1 for d in ev["details"]["devices"].values())
    assert len(ev["details"]["links"]) == 4 and ev["details"]["untested"] == []
    assert workers_left() == []


def test_bad_input_is_one_line():
    r = run_cli("validate")
    assert r.returncode == 2 and "either PIDs of a running job or --world N" in r.stderr
    r = run_cli("validate", "--world", "1")
    assert r.returncode == 2 and "at least 2" in r.stderr
    r = run_cli("validate", "999999999")
    assert r.returncode in (1, 2) and r.stderr.count("\n") == 1


def test_an_interpreter_without_numpy_or_torch_is_one_line():
    """CPU workers need NumPy (or PyTorch): the system python here has neither."""
    r = run_cli("validate", "--world", "2", "--python", "/usr/bin/python3")
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "validation needs NumPy (or PyTorch) in /usr/bin/python3" in r.stderr


def test_cpu_workers_measure_without_torch():
    """A CPU rank's worker is NumPy and sockets: it never maps libtorch
    (about 3 CPU s to import, beside the running job), and measures a GEMM
    and a link all the same."""
    from greyhound_bpf.diagnosis.host import Member
    from greyhound_bpf.diagnosis.workers import Worker
    env = {"MASTER_ADDR": "127.0.0.1"}
    ws = [Worker(Member(r, env=env), 2, 20) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        port = ws[0].read(deadline, ("port",))["port"]
        for w in ws:
            w.send({"cmd": "join", "addr": "127.0.0.1", "port": port})
        assert [w.read(deadline, ("ready",))["backend"] for w in ws] == ["tcp", "tcp"]
        ws[1].send({"cmd": "gemm", "seconds": 0.2})
        gemm = ws[1].read(deadline, ("ms_per_gemm", "gflops"))
        assert gemm["gemms"] >= 2 and gemm["gflops"] > 0.5, gemm
        for me, peer in ((0, 1), (1, 0)):
            ws[me].send({"cmd": "p2p", "peer": peer, "bytes": 1 << 20, "seconds": 0.1})
        link = ws[0].read(deadline, ("rtt_ms", "gbps", "lat_us"))
        assert ws[1].read(deadline, ("rtt_ms",))["round_trips"] == link["round_trips"] >= 3
        assert 0 < link["rtt_min_ms"] <= link["rtt_ms"] <= link["rtt_median_ms"], link
        assert link["gbps"] > 0.1, link
        for w in ws:
            maps = open(f"/proc/{w.proc.pid}/maps").read()
            assert "libtorch" not in maps and "numpy" in maps
    finally:
        for w in ws:
            w.kill()


@pytest.mark.bpf
@pytest.mark.slow
def test_cpu_quota_straggler_is_measured(ddp_job, tmp_path):
    job = ddp_job(4, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
    from greyhound_bpf.probe.discovery import descendants, rank_identity
    ranks = {rank_identity(p)[0]: p for p in descendants([job.proc.pid], all_stats())
             if rank_identity(p)[0] is not None}
    out = tmp_path / "v.jsonl"
    with CpuQuota(ranks[2], 0.5):
        # The slow rank's own PID, as a user who saw it in `top` gives it:
        # its job's four devices are measured, so there is a reference.
        r = run_cli("validate", str(ranks[2]), "-o", str(out), timeout=180)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"pid {ranks[2]} is rank 2 of 4, under torchrun (pid {job.proc.pid})" in r.stderr
    (ev,) = read_events(out)
    assert (ev["cause"], ev["ranks"], ev["evidence"]) == ("computation", [2], "validation")
    assert sorted(ev["details"]["devices"]) == ["0", "1", "2", "3"]
    assert 0 < ev["details"]["paused_s"] <= 5
    assert "SLOW" in r.stdout
    # The job was only paused: it goes on training.
    n = len(job.truth_records())
    wait_for(lambda: len(job.truth_records()) > n + 3, 60, "the job to go on")
    assert job.proc.poll() is None
    assert workers_left() == []


@pytest.mark.bpf
@pytest.mark.slow
def test_a_device_slow_only_for_a_moment_is_not_named(ddp_job):
    """Rank 2 under a CPU quota for the first pause only (a busy moment of a
    shared host, made real): its GEMM reads slow twice, the confirmation
    after the job has run again reads it healthy, and nothing is named."""
    from greyhound_bpf.diagnosis import validator as validate
    job = ddp_job(4, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
    members = validate.members_for_job([job.proc.pid])
    pid2 = next(m.pid for m in members if m.rank == 2)
    # Half a CPU: its GEMM reads x2 or more (x3+ on a loaded 2-core CI
    # host, where the skip rule would name it in the first pause: that rule
    # is test_cpu_quota_straggler_is_measured's; off here, so that this
    # test is about the confirmation whatever the host's load).
    quota = CpuQuota(pid2, 0.5)
    said = []

    def progress(msg):
        said.append(msg)
        if msg.startswith("confirming"):
            quota.undo()                            # the moment is over

    v = validate.Validator(members, progress=progress, confirm_skip_ratio=float("inf"))
    try:
        v.start()
        quota.apply()
        res = v.measure()
    finally:
        quota.undo()
        v.close()
    fields = decide(res)
    assert any(m.startswith("confirming rank 2") for m in said), said
    assert res.pauses == 2 and res.devices[2]["passes"] == 3, (said, res)
    assert fields["cause"] == "unknown" and fields["ranks"] == [], fields
    assert res.paused_s <= 5
    assert workers_left() == []


@pytest.mark.bpf
@pytest.mark.slow
def test_a_device_the_passive_verdict_named_needs_no_second_pause(ddp_job):
    """Rank 2 at 0.3 CPU, named by the passive verdict that asked: measured
    slow twice in the pause (x2 or more), two kinds of evidence agree and
    the job is not paused again 3 s later; the same measurement with no
    suspect named waits and confirms (the test above)."""
    from greyhound_bpf.diagnosis import validator as validate
    job = ddp_job(4, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
    members = validate.members_for_job([job.proc.pid])
    pid2 = next(m.pid for m in members if m.rank == 2)
    said = []
    v = validate.Validator(members, progress=said.append, confirm_skip_ratio=float("inf"))
    try:
        v.start()
        with CpuQuota(pid2, 0.3):
            res = v.measure(suspects=[2])
    finally:
        v.close()
    fields = decide(res)
    assert not any(m.startswith("confirming") for m in said), said
    assert res.pauses == 1 and res.devices[2]["passes"] >= 2, (said, res)
    assert (fields["cause"], fields["ranks"]) == ("computation", [2]), fields
    assert workers_left() == []


def test_cpu_gemms_run_at_once_only_where_ranks_have_cpus_of_their_own():
    from greyhound_bpf.diagnosis.validator import disjoint
    assert disjoint([{0}, {1}]) and disjoint([{0, 1}, {2}, {3}])
    assert not disjoint([{0, 1}, {1}])          # ranks share a core: one at a time
    assert not disjoint([{0}, None])            # one not known
    assert not disjoint([{0, 1}, {0, 1}])


@pytest.mark.bpf
@pytest.mark.slow
def test_ranks_on_cores_of_their_own_are_measured_at_once(ddp_job):
    """2 ranks pinned one per core: their GEMMs run at once (one pause half
    as long as one after another), a healthy pair reads no suspect, and
    rank 1 at half a CPU is named, next to rank 0 measured at the same
    moment."""
    import os
    from greyhound_bpf.diagnosis import validator as validate
    if os.cpu_count() < 2:
        pytest.skip("needs 2 CPUs to give each rank one of its own")
    job = ddp_job(2, 0, "--pin", go=False)          # a core each, as GPU ranks a device
    wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
    members = validate.members_for_job([job.proc.pid])
    said = []
    v = validate.Validator(members, progress=said.append)
    try:
        v.start()
        healthy = v.measure()
        with CpuQuota(next(m.pid for m in members if m.rank == 1), 0.5):
            slow = v.measure()
    finally:
        v.close()
    assert any(m == "GEMM on 2 device(s) at once" for m in said), said
    assert decide(healthy)["ranks"] == [], (said, healthy)
    fields = decide(slow)
    assert (fields["cause"], fields["ranks"]) == ("computation", [1]), (said, slow)
    assert workers_left() == []


@pytest.mark.bpf
@pytest.mark.slow
def test_rate_limited_link_is_named(tmp_path):
    truth = tmp_path / "truth.jsonl"
    out = tmp_path / "v.jsonl"
    bed = NetBed(4, prefix="ghv")
    with bed:
        pids = bed.start_ranks(truth, "--microbatches", "2", "--mb-size", "32",
                               "--hidden", "256", "--layers", "2", port=29733)
        wait_for(lambda: len(read_events(truth)) >= 20, 120, "the job to train")
        with LinkRate(bed.host_dev(1), "400mbit"):
            r = run_cli("validate", *map(str, pids), "-o", str(out), timeout=180)
        assert r.returncode == 3, r.stdout + r.stderr
        (ev,) = read_events(out)
        assert (ev["cause"], ev["link"], ev["ranks"]) == ("communication", "rank 1", [1])
        links = ev["details"]["links"]
        assert links["0<->1"]["rtt_ms"] > 3 * links["2<->3"]["rtt_ms"]
        assert all(p.poll() is None for p in bed.procs)       # still training
    assert bed.leftovers() == []
    assert workers_left() == []


def test_edges_follow_the_communicator_map():
    from greyhound_bpf.diagnosis.rules import edges_of
    topo = {"communicators": [{"ranks": [0, 1, 2, 3]}, {"ranks": [2, 0]}],
            "p2p_edges": [[1, 3]]}
    got = edges_of(topo, [0, 1, 2, 3])
    assert set(got) == {(0, 1), (1, 2), (2, 3), (3, 0), (2, 0), (1, 3)}
    assert edges_of(None, [2, 0, 1]) == [(0, 1), (1, 2), (2, 0)]
    assert edges_of(topo, [0, 1]) == [(0, 1)]


def test_one_validation_measures_at_a_time():
    from greyhound_bpf.diagnosis.host import MeasureLock
    with MeasureLock() as first:
        assert first
        other = MeasureLock(timeout_s=0.3)
        assert other.__enter__() is False
        other.__exit__()
    again = MeasureLock(timeout_s=0.3)
    assert again.__enter__() is True
    again.__exit__()


def test_agents_on_one_machine_measure_their_devices_one_at_a_time():
    """Nodes simulated on one host (the cluster tests): node a's device
    measurement holds the machine's lock against node b's (three nodes'
    GEMMs at once on 2 cores read one device x1.56), while each node's own
    lock, which links between nodes take, stays free."""
    from greyhound_bpf.diagnosis.announce import set_node
    from greyhound_bpf.diagnosis.host import MeasureLock
    try:
        set_node("a")
        with MeasureLock(machine=True) as first:
            assert first
            set_node("b")
            other = MeasureLock(timeout_s=0.3, machine=True)
            assert other.__enter__() is False
            other.__exit__()
            mine = MeasureLock(timeout_s=0.3)
            assert mine.__enter__() is True
            mine.__exit__()
    finally:
        set_node(None)


@pytest.mark.bpf
@pytest.mark.slow
def test_a_healthy_job_under_attach_and_validate(ddp_job, tracer, tmp_path):
    """A healthy job under attach for 45 s, with `validate` run twice
    besides (one measurement at a time on the machine, attach's own
    validations included): no diagnosis beyond `unknown`, no slow device or
    link, no plan, no job slowdown its own log does not show, and the job
    trains on. (scripts/bench_soak runs the same for 10 minutes.)"""
    job = ddp_job(4, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
    t = tracer([job.proc.pid], "-q")
    t.wait_attached(4)
    t0 = time.monotonic()
    runs, started = [], []
    for i in range(2):
        time.sleep(max(0.0, t0 + 15 + 15 * i - time.monotonic()))
        out = tmp_path / f"v{i}.jsonl"
        started.append(time.time_ns())
        r = run_cli("validate", str(job.proc.pid), "-o", str(out), timeout=180)
        runs.append((r, read_events(out)))
    time.sleep(max(0.0, t0 + 45 - time.monotonic()))
    assert job.proc.poll() is None
    assert t.stop() == 0
    # Each `validate` this test starts loads the 2-core host from its first
    # moment; it announces itself (an `other` span) after its interpreter
    # starts (~0.1 s). A slowdown beginning in those first moments, which
    # the test itself disturbed, is left out of the check; everywhere else
    # a job slowdown must be in the job's own log.
    own = [(s - int(0.2e9), s + int(1e9)) for s in started]
    made_up = [e for e in unconfirmed_slowdowns(t.events(), job.truth_records())
               if not any(lo <= e["onset_ns"] < hi for lo, hi in own)]
    when = f"validate began at {[t.since_attach(s) for s in started]} s"
    assert made_up == [], f"{when}\n{t.story()}"
    assert [e for e in t.events("action") if e.get("strategy") != "none"] == []
    for r, evs in runs:
        assert r.returncode == 0, r.stdout + r.stderr
        (ev,) = evs
        assert ev["cause"] == "unknown" and ev["link"] is None and ev["ranks"] == []
        assert ev["details"]["untested"] == [] and len(ev["details"]["links"]) == 4
        assert ev["details"]["paused_s"] <= 5
    named = [e for e in t.events("diagnosis") if e["cause"] != "unknown"]
    assert named == [], f"{when}\n{t.story()}"
    assert workers_left() == []


def test_busy_is_announced_while_it_lasts():
    from greyhound_bpf.diagnosis.announce import Busy, busy_since
    assert busy_since() is None
    with Busy("start"):
        since = busy_since()
        assert since is not None and abs(since - time.time_ns()) < 5e9
    assert busy_since() is None


# Run in a fresh interpreter: `validate` from its first import to its end,
# with what a tracer on this machine sees of it (busy_since): when the
# command first imports NumPy (its heavy start-up begins), and every 20 ms
# while it runs (a later announcement replacing the first would show as a
# later `since`).
_WATCH_VALIDATE = """
import importlib.abc, json, sys, threading
from greyhound_bpf.diagnosis.announce import Busy
def since():                    # as busy_since, without its liveness check's imports
    found = []
    for f in Busy.directory().glob("*.json"):
        try:
            found.append(json.loads(f.read_text())["since_ns"])
        except (OSError, ValueError):
            pass
    return min(found, default=None)
seen = {"since": []}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "numpy" and "numpy" not in seen:
            seen["numpy"] = since()
        return None
sys.meta_path.insert(0, Watch())
done = threading.Event()
def poll():
    while not done.wait(0.02):
        s = since()
        if s is not None and s not in seen["since"]:
            seen["since"].append(s)
threading.Thread(target=poll, daemon=True).start()
from greyhound_bpf.cli import main
rc = main(sys.argv[1:])
done.set()
seen["after"] = since()
print(json.dumps(seen))
sys.exit(rc)
"""


def test_validate_is_announced_from_before_its_imports_until_it_ends(tmp_path):
    """A tracer beside `validate` keeps the job's iterations out while it
    loads the host: it must see it before the first heavy import (a 2-core
    host lost 0.65-0.92 s of it otherwise), as one span to the end (a gap
    between the interpreter check and the validator's own announcement hid
    a whole start-up from a tracer polling once a second)."""
    import json
    import sys
    from greyhound_bpf.diagnosis.announce import busy_since
    assert busy_since() is None
    r = subprocess.run([sys.executable, "-c", _WATCH_VALIDATE, "validate", "--world", "2",
                        "--no-pause", "-o", str(tmp_path / "v.jsonl")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["numpy"] is not None, seen
    assert seen["since"] == [seen["numpy"]], seen      # one span, from the start
    assert seen["after"] is None and busy_since() is None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_pause_watchdog_resumes_the_job_even_if_we_never_do():
    from greyhound_bpf.diagnosis.host import Pause
    job = subprocess.Popen(["sleep", "60"])
    try:
        p = Pause([job.pid], max_s=1.0).__enter__()
        wait_for(lambda: _state(job.pid) == "T", 0.8, "the job to stop")
        # As if this process had been killed: never __exit__ until later.
        wait_for(lambda: _state(job.pid) != "T", 5, "the watchdog's SIGCONT")
        p.__exit__()
        assert p.seconds <= 1.0 and p.watchdog.poll() is not None
    finally:
        job.kill()
        job.wait()


def test_workers_that_never_answer_time_out_and_are_killed(tmp_path):
    from greyhound_bpf.diagnosis.host import Member
    from greyhound_bpf.diagnosis.validator import Validator
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 617\n")       # a worker that hangs at start
    fake.chmod(0o755)
    t0 = time.monotonic()
    res = Validator([Member(0), Member(1)], start_timeout_s=2, python=str(fake)).run()
    assert time.monotonic() - t0 < 10
    assert res.devices == {} and res.links == {}
    assert any("no answer in time" in u for u in res.untested), res.untested
    left = subprocess.run(["pgrep", "-f", "sleep 617"], capture_output=True, text=True).stdout
    assert left == ""


def test_a_rank_whose_gpu_is_unknown_is_not_measured_as_another():
    """A GPU rank whose device could not be placed (diagnosis/gpus.py) gets
    no GEMM, said in `untested`: before, it was measured on GPU 0. Real
    workers (on the CPU here; the rule is the placement, not the device)."""
    from greyhound_bpf.diagnosis.host import Member
    from greyhound_bpf.diagnosis.validator import Validator
    env = {"MASTER_ADDR": "127.0.0.1"}
    res = Validator([Member(0, env=env), Member(1, env=env, placement="unknown: no local rank")],
                    pause=False).run()
    assert sorted(res.devices) == [0], res.devices
    assert any(u.startswith("rank 1: its GPU is unknown: no local rank") for u in res.untested)
    assert "0<->1" in res.links or any("links" in u for u in res.untested), res


def test_cpu_workers_stay_warm_and_gpu_workers_do_not():
    """attach's validation service keeps CPU workers idle between requests
    (importing torch costs seconds), but never keeps GPU workers: each would
    hold a CUDA context on the job's GPU. (No GPU here: the GPU workers fail
    to start, and nothing of them may be left either way.)"""
    import queue
    from greyhound_bpf.diagnosis.host import Member
    from greyhound_bpf.diagnosis.service import Service
    got = queue.SimpleQueue()
    svc = Service(lambda kind, payload: got.put((kind, payload)), time.time_ns)
    try:
        def result(request_id):
            while True:
                kind, payload = got.get(timeout=120)
                if kind == "result" and payload[0] == request_id:
                    return payload[1]
        env = {"MASTER_ADDR": "127.0.0.1"}
        cpu = [Member(0, env=env), Member(1, env=env)]
        svc.request(1, cpu, [(0, 1)])
        assert sorted(result(1).devices) == [0, 1]
        assert svc.pool is not None and svc.pool.alive() and len(workers_left()) == 2
        gpu = [Member(0, device="cuda:0", env=env), Member(1, device="cuda:0", env=env)]
        svc.request(2, gpu, [(0, 1)])
        res = result(2)
        assert res.devices == {} and res.untested, res
        assert svc.pool is None
        wait_for(lambda: workers_left() == [], 15, "no worker left")
    finally:
        svc.close()
