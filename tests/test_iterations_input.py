"""The analysis fed iterations instead of calls (issue #14's base: a node's
agent finds each rank's iterations in its calls and publishes them, with
its communicator map; the job's controller runs JobAnalysis over every
node's iterations and maps). Over the corpus's real recordings, an analysis
fed the iterations and the map a first one found says exactly what the
first one says: the same slowdowns, verdicts, validation requests and plans
at the same moments. Without the map, a link verdict names no
communicator, and that is the only difference."""
import pytest

import corpus
from greyhound_bpf.analysis import Calls, Collectives, Communicators, Iterations, JobAnalysis
from greyhound_bpf.probe.catalog import load_catalog
from greyhound_bpf.recording import Recording, encode

def both(name: str, maps: bool = False, collectives: bool = False) -> tuple[list[dict], list[dict]]:
    """(events of the analysis fed the recording's calls, events of one fed
    the iterations the first found, batch by batch, and with `maps` its
    communicator maps, with `collectives` its shared collectives, as a node's
    agent forwards them; everything else alike)."""
    cat = load_catalog()
    rec = Recording(str(corpus.SCENARIOS / f"{name}.rec.gz"), cat)
    calls, its = JobAnalysis(cat, rec.job, rec.config), JobAnalysis(cat, rec.job, rec.config)
    ea, eb = [], []
    calls.shared_collectives()                  # (kept from the first call on)
    for inp in rec.inputs():
        out = calls.feed(inp)
        ea += out
        for e in out if maps else ():
            if e["kind"] == "topology":
                eb += its.feed(Communicators(inp.t_ns, "n0", {
                    k: e[k] for k in ("communicators", "p2p_edges")}))
        if not isinstance(inp, Calls):
            eb += its.feed(inp)
            continue
        pid_of = {r: p for p, r in calls.rank_of().items()}
        for r, items in sorted(corpus.iterations_by_rank(out).items()):
            eb += its.feed(Iterations(inp.t_ns, pid_of[r], tuple(items)))
        shared = calls.shared_collectives()
        if collectives and shared:
            eb += its.feed(Collectives(inp.t_ns, {pid_of[r]: tuple(v) for r, v in shared.items()}))
    return ea, eb


def downstream(events: list[dict]) -> list[dict]:
    """What follows the iteration estimator (its `pattern` events and the
    calls' communicator map are the agent's), in a stable order."""
    keep = [e for e in events if e["kind"] not in ("pattern", "topology")]
    return sorted(keep, key=lambda e: (e["time_ns"], e["kind"], str(e.get("rank"))))


@pytest.mark.parametrize("name", ["compute-demo4-r2", "preslow-user4-r2-strong",
                                  "heldout-early-demo4-r1", "compute-localsgd3-r1"])
def test_iterations_give_what_calls_give(name):
    ea, eb = both(name)
    a, b = downstream(ea), downstream(eb)
    assert any(e["kind"] == "diagnosis" and e["cause"] == "computation" for e in a)
    assert a == b


@pytest.mark.parametrize("name", ["preslow-fairseq3-r2", "compute-fairseq3-r1",
                                  "preslow-vit3-r2"])
def test_a_job_sparse_in_collectives_is_judged_from_the_collectives_shared(name):
    """Jobs too slow and sparse in collectives to count their iterations
    in time are named by the call-by-call look (diagnosis/callcross.py),
    which an analysis fed iterations cannot run: fed the collectives a
    node's agent shares, it says what the first one says. Without them it
    says less (that is why they are sent)."""
    ea, eb = both(name, collectives=True)
    a, b = downstream(ea), downstream(eb)
    assert any(e["kind"] == "diagnosis" and e["details"].get("calls") for e in a)
    assert a == b
    _, bare = both(name)
    assert downstream(bare) != a


def test_a_new_period_restarts_the_detectors_of_an_analysis_fed_iterations():
    """Post-local SGD, healthy: DDP's warm-up, one step an iteration, then
    4 steps between averagings. A `pattern` event is the agent's own: the
    controller reads the new period from the iterations and restarts its
    detectors as the agent's analysis did (without it, a slowdown of x1.3
    at the change, on every rank and the job's, and one more diagnosis)."""
    ea, eb = both("healthy-localsgd3")
    assert any(e["kind"] == "pattern" and e["previous"] not in (None, e["period_calls"])
               for e in ea)
    a, b = downstream(ea), downstream(eb)
    assert not [e for e in b if e["kind"] == "diagnosis" and e["cause"] != "unknown"]
    assert a == b


def test_a_link_verdict_lacks_only_the_communicator():
    ea, eb = both("link-demo4-r1")
    a, b = downstream(ea), downstream(eb)
    assert len(a) == len(b)
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    assert differ, "the communicator map came from somewhere"
    for x, y in differ:
        # (The suspicion said before it is named names no communicator:
        # only its reason says "of gloo:0".)
        assert x["kind"] == y["kind"] == "diagnosis"
        assert (x["communicator"] and y["communicator"] is None) or \
            x["details"].get("suspected_cause") == y["details"].get("suspected_cause") \
            == "communication"
        assert {k: v for k, v in x.items() if k not in ("communicator", "reason")} == \
            {k: v for k, v in y.items() if k not in ("communicator", "reason")}


def test_iterations_are_recorded_and_read_back(tmp_path):
    import gzip
    import json
    inp = Iterations(5, 1234, ({"index": 0, "start_ns": 10, "dur_ns": 20, "period_calls": 2,
                                "comm_ns": 5, "compute_ns": 15},))
    src = Recording(str(corpus.SCENARIOS / "healthy-demo4.rec.gz"), load_catalog())
    path = tmp_path / "r.rec.gz"
    with gzip.open(src.path, "rt") as fh:
        header = fh.readline()
    comms = Communicators(6, "n1", {"communicators": [{"name": "gloo:0", "ranks": [2, 3]}],
                                    "p2p_edges": [[2, 3]]})
    coll = Collectives(7, {1234: ((None, 10, 30), (5, 35, 60)), 1235: ((None, 12, 31),)})
    with gzip.open(path, "wt") as fh:
        fh.write(header + "".join(json.dumps(encode(x)) + "\n" for x in (inp, comms, coll)))
    assert list(Recording(str(path), load_catalog()).inputs()) == [inp, comms, coll]


def test_with_the_nodes_map_a_link_verdict_names_its_communicator():
    ea, eb = both("link-demo4-r1", maps=True)
    a, b = downstream(ea), downstream(eb)
    assert [e for e in a if e["kind"] == "diagnosis" and e.get("communicator")]
    assert a == b
