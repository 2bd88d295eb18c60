"""The state gauges say what is true now, from the events (no tracer: the
live scrape is tests/test_metrics.py)."""
import pytest

from greyhound_bpf.output.metrics import Metrics


@pytest.fixture
def metrics():
    m = Metrics(0)
    yield m
    m.close()


def value(m, name, **labels):
    return m.registry.get_sample_value(name, labels)


def it(rank, i):
    return {"kind": "iteration", "rank": rank, "index": i, "dur_ns": 30_000_000}


def test_a_healthy_job_has_no_straggler_and_no_slowdown(metrics):
    for i in range(3):
        metrics(it(0, i))
        metrics(it(1, i))
    # The host slowed every rank for a moment: each rank's detector and the
    # job's said so, and then the job recovered. Nobody is a straggler.
    for ev in ({"kind": "slowdown", "scope": "rank", "rank": 0},
               {"kind": "slowdown", "scope": "rank", "rank": 1},
               {"kind": "slowdown", "scope": "job", "rank": None},
               {"kind": "diagnosis", "cause": "unknown", "ranks": []}):
        metrics(ev)
    assert value(metrics, "greyhound_straggler", rank="0") == 0
    assert value(metrics, "greyhound_straggler", rank="1") == 0
    assert value(metrics, "greyhound_slowdown_active") == 1
    metrics({"kind": "recovery", "scope": "job", "rank": None})
    assert value(metrics, "greyhound_slowdown_active") == 0


def test_the_named_straggler_until_the_job_recovers(metrics):
    metrics(it(0, 0))
    metrics(it(1, 0))
    metrics({"kind": "slowdown", "scope": "job", "rank": None})
    metrics({"kind": "diagnosis", "cause": "computation", "ranks": [1]})
    assert value(metrics, "greyhound_straggler", rank="1") == 1
    assert value(metrics, "greyhound_straggler", rank="0") == 0
    metrics({"kind": "diagnosis", "cause": "computation", "ranks": [0]})   # it moved
    assert (value(metrics, "greyhound_straggler", rank="0"),
            value(metrics, "greyhound_straggler", rank="1")) == (1, 0)
    metrics({"kind": "recovery", "scope": "job", "rank": None})
    assert value(metrics, "greyhound_straggler", rank="0") == 0


def test_calls_of_no_known_rank_carry_no_rank_label(metrics):
    metrics.count_calls([(4242, 0, 5)], {4242: None}, ["gloo::allreduce"])
    # An empty label value is the same as no label to Prometheus.
    assert value(metrics, "greyhound_calls_total", rank="", fn="gloo::allreduce") == 5
