"""`episode` links a fault's events (docs/events.md): over recorded real
runs replayed through the analysis, a verdict that names a cause, the
validation it asks for, the verdict of that validation and the plan that
follows are one episode; a new fault after the job recovered is another;
and the controller merges its nodes' measurements into one result."""
import corpus
from greyhound_bpf.cluster.controller import merge_results
from greyhound_bpf.diagnosis.rules import Result, decide


def test_a_faults_events_are_one_episode_and_the_next_fault_another():
    evs = [e for e in corpus.replay("twofaults-demo4") if e["kind"] != "iteration"]
    named = [e for e in evs if e["kind"] == "diagnosis" and e["cause"] == "computation"]
    assert {tuple(e["ranks"]) for e in named} == {(1,), (3,)}
    ep = {r: {e["episode"] for e in named if e["ranks"] == [r]} for r in (1, 3)}
    # Rank 1's fault: one episode (its verdicts, the validation, the plan).
    # Rank 3's: others (the job recovered for a moment within it: a verdict
    # after a recovery is a new fault to the analysis, and a new episode).
    assert len(ep[1]) == 1 and not ep[1] & ep[3], ep
    plan = next(e for e in evs if e["kind"] == "action" and e["strategy"] != "none")
    assert {plan["episode"]} == ep[1]
    assert all(e["episode"] is not None for e in named)
    # A validation's verdict is in its request's episode.
    requests = {e["id"]: e["episode"] for e in evs
                if e["kind"] == "validation" and e["phase"] == "request"}
    validated = [e for e in evs if e["kind"] == "diagnosis" and e["evidence"] == "validation"]
    assert validated
    for e in validated:
        assert e["episode"] == requests[e["details"]["request"]], e
    # Episodes only grow, and a job recovery closes the one open.
    seen = [e["episode"] for e in evs if e.get("episode") is not None]
    assert seen == sorted(seen)
    for i, e in enumerate(evs):
        if e["kind"] == "recovery" and e["scope"] == "job":
            later = next((x for x in evs[i + 1:] if x["kind"] == "slowdown"
                          and x["scope"] == "job"), None)
            if later is not None:
                assert later["episode"] > e["episode"]


def test_merged_node_measurements_decide_as_one():
    a = Result(devices={0: {"ms_per_gemm": 3.0}, 1: {"ms_per_gemm": 3.1}},
               links={(0, 1): {"rtt_ms": 2.0}}, paused_s=1.2, measured_at_ns=5)
    b = Result(devices={2: {"ms_per_gemm": 36.0}, 3: {"ms_per_gemm": 2.9}},
               links={(2, 3): {"rtt_ms": 2.1}}, paused_s=2.0, measured_at_ns=4,
               untested=["rank 3: something"])
    merged = merge_results({"a": a.to_dict(), "b": b.to_dict()},
                           ["1<->2: between nodes a and b, not measured"])
    res = Result.from_dict(merged)
    assert sorted(res.devices) == [0, 1, 2, 3] and sorted(res.links) == [(0, 1), (2, 3)]
    assert res.paused_s == 2.0 and res.measured_at_ns == 4
    assert res.untested == ["1<->2: between nodes a and b, not measured",
                            "node b: rank 3: something"]
    v = decide(res)
    assert (v.cause, list(v.ranks)) == ("computation", [2])
    assert merge_results({}, [])["devices"] == {}
