"""JobAnalysis's own rules, fed its inputs directly (no tracer, no clock)."""
from greyhound_bpf.analysis import JobAnalysis, Validated
from greyhound_bpf.diagnosis.rules import Result
from greyhound_bpf.diagnosis.verdict import Diagnosis
from greyhound_bpf.probe.catalog import load_catalog

S = 1_000_000_000


def slow_rank(rank: int) -> dict:
    """Measurements naming `rank`'s device slow (x6, measured three times)."""
    devices = {r: {"ms_per_gemm": 18.0 if r == rank else 3.0 + 0.05 * r, "gflops": 1.0,
                   "passes": 3} for r in range(4)}
    return Result(devices=devices).to_dict()


def diagnoses(events: list[dict]) -> list[tuple]:
    return [(e["evidence"], e["cause"], e["ranks"]) for e in events if e["kind"] == "diagnosis"]


def test_every_validation_verdict_is_said():
    """The same rank measured slow twice, 30 s apart (a fault again on it):
    each answer is a verdict. bench_diagnosis lost 2 of 20 faults when the
    second answer was dropped as said already."""
    a = JobAnalysis(load_catalog(), "job")
    first = a.feed(Validated(100 * S, 1, slow_rank(2)))
    again = a.feed(Validated(130 * S, 2, slow_rank(2)))
    assert diagnoses(first) == diagnoses(again) == [("validation", "computation", [2])]


def test_a_passive_verdict_is_said_once_per_episode():
    a = JobAnalysis(load_catalog(), "job")
    v = Diagnosis("passive", "communication", "every rank waits", ranks=(0, 1, 2, 3))
    t = 100 * S
    assert len(a._verdicts([v], t)) >= 1
    # Said again 20 s later in the same episode (the other passive method):
    # nothing new.
    v2 = Diagnosis("passive", "communication", "every rank waits", ranks=(0, 1, 2, 3))
    assert diagnoses(a._verdicts([v2], t + 20 * S)) == []
    # After the job recovered, the same verdict is a new fault's.
    a._observe({"kind": "recovery", "scope": "job", "time_ns": t + 25 * S, "rank": None,
                "ratio": 0.5})
    v3 = Diagnosis("passive", "communication", "every rank waits", ranks=(0, 1, 2, 3))
    assert diagnoses(a._verdicts([v3], t + 40 * S)) == [("passive", "communication",
                                                           [0, 1, 2, 3])]
