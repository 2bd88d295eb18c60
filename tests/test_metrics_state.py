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
               {"kind": "diagnosis", "cause": "unknown", "evidence": "passive", "ranks": []}):
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
    metrics({"kind": "diagnosis", "cause": "computation", "evidence": "passive",
             "ranks": [1]})
    assert value(metrics, "greyhound_straggler", rank="1") == 1
    assert value(metrics, "greyhound_straggler", rank="0") == 0
    metrics({"kind": "diagnosis", "cause": "computation", "evidence": "passive",
             "ranks": [0]})                                          # it moved
    assert (value(metrics, "greyhound_straggler", rank="0"),
            value(metrics, "greyhound_straggler", rank="1")) == (1, 0)
    metrics({"kind": "recovery", "scope": "job", "rank": None})
    assert value(metrics, "greyhound_straggler", rank="0") == 0


def test_calls_of_no_known_rank_carry_no_rank_label(metrics):
    metrics.count_calls([(4242, 0, 5)], {4242: None}, ["gloo::allreduce"])
    # An empty label value is the same as no label to Prometheus.
    assert value(metrics, "greyhound_calls_total", rank="", fn="gloo::allreduce") == 5


def test_what_a_dashboard_joins_and_rates(metrics):
    from greyhound_bpf import __version__
    assert value(metrics, "greyhound_build_info", version=__version__) == 1
    uuid = "GPU-5a1b2c3d-0000-4000-8000-000000000005"
    metrics({"kind": "attach", "job": "llama-7b", "ranks": [
        {"pid": 11, "rank": 0, "local_rank": 0, "gpu": uuid},
        {"pid": 12, "rank": 1, "local_rank": None}]})
    # gpu_uuid joins with DCGM's UUID; a rank with no GPU (or none found) has none.
    assert value(metrics, "greyhound_rank_info", rank="0", local_rank="0", pid="11",
                 node=metrics.node, gpu_uuid=uuid, training_job="llama-7b") == 1
    assert value(metrics, "greyhound_rank_info", rank="1", local_rank="", pid="12",
                 node=metrics.node, gpu_uuid="", training_job="llama-7b") == 1
    for i, ms in enumerate((20, 40, 3000)):
        metrics({"kind": "iteration", "rank": 0, "index": i, "dur_ns": ms * 1_000_000})
    # A disturbed iteration (ours) is no sample of the job's speed.
    metrics({"kind": "iteration", "rank": 0, "index": 3, "dur_ns": 10**9, "disturbed": True})
    assert value(metrics, "greyhound_iteration_duration_seconds_count", rank="0") == 3
    assert value(metrics, "greyhound_iteration_duration_seconds_bucket", rank="0",
                 le="0.05") == 2
    metrics({"kind": "diagnosis", "cause": "computation", "evidence": "validation",
             "ranks": [0]})
    metrics({"kind": "diagnosis", "cause": "unknown", "evidence": "passive", "ranks": []})
    assert value(metrics, "greyhound_diagnoses_total", cause="computation",
                 evidence="validation") == 1
    metrics({"kind": "activity", "what": "pause", "id": "p1", "start_ns": 0, "end_ns": None})
    metrics({"kind": "activity", "what": "pause", "id": "p1", "start_ns": 0,
             "end_ns": 2_500_000_000})
    assert value(metrics, "greyhound_validation_pause_seconds_total") == 2.5
    metrics({"kind": "action", "strategy": "rebalance_microbatches", "mode": "mitigate",
             "seq": 3, "plan": {"microbatches": {"0": 6, "1": 10}}})
    assert (value(metrics, "greyhound_plan_seq"),
            value(metrics, "greyhound_plan_microbatches", dp_rank="0")) == (3, 6)


def test_docs_metrics_lists_every_metric_with_its_type_and_labels(metrics):
    """docs/metrics.md's table and the registry agree: every metric served
    is documented with its type and labels, and nothing documented is gone."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    rows = {}
    for m in re.finditer(r"^\| `(greyhound_\w+)` \| ([a-z]+)[^|]*\| ([^|]*)\|", doc, re.M):
        rows[m.group(1)] = (m.group(2), set(re.findall(r"`(\w+)`", m.group(3))))
    served = {}
    for fam in metrics.registry.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = set()
        for s in fam.samples:
            labels |= set(s.labels) - {"le"}
        served[name] = (fam.type, labels)
    # Families with no sample yet have no labels to read: take them from
    # the collector's own declaration.
    for name, (kind, labels) in served.items():
        assert name in rows, f"{name} is served but not in docs/metrics.md"
        assert rows[name][0] == kind, (name, rows[name][0], kind)
        assert labels <= rows[name][1], (name, labels, rows[name][1])
    assert set(rows) == set(served), set(rows) ^ set(served)
    declared = {c._name + ("_total" if c._type == "counter" else ""): set(c._labelnames)
                for c in metrics.registry._collector_to_names}
    for name, labels in declared.items():
        assert labels == rows[name][1], (name, labels, rows[name][1])
