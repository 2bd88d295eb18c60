"""The demo's summary (scripts/demo_story.py) on fixed events: which
verdict is the fault's validated one. No root, no job."""
import importlib.util

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("demo_story", ROOT / "scripts" / "demo_story.py")
demo_story = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_story)

INJ = 1_000


def diagnosis(t, cause, ranks):
    return {"kind": "diagnosis", "time_ns": t, "evidence": "validation", "cause": cause,
            "ranks": ranks}


def confirmation(t, rank=2):
    return {"kind": "validation", "time_ns": t, "confirmed_by": "plan",
            "cause": "computation", "ranks": [rank]}


def test_the_plans_confirmation_outlives_a_later_unknown_validation():
    """A CI run's case: the plan confirmed rank 2, then a busy host's
    slowdown after the lift was validated and measured nothing."""
    d, rank = demo_story.validated_verdict(
        [confirmation(2_000), diagnosis(9_000, "unknown", [])], INJ)
    assert rank == 2 and d["confirmed_by"] == "plan", d


def test_a_validation_that_named_the_rank_first_stands():
    d, rank = demo_story.validated_verdict(
        [diagnosis(1_500, "computation", [1]), confirmation(2_000)], INJ)
    assert rank == 1 and d["evidence"] == "validation", d


def test_nothing_validated_is_nothing():
    assert demo_story.validated_verdict([confirmation(500)], INJ) == (None, None)
    d, rank = demo_story.validated_verdict([diagnosis(3_000, "unknown", [])], INJ)
    assert rank is None and d["cause"] == "unknown"
