"""Prometheus metrics, scraped over real HTTP while attached to a real gloo
DDP job; the port is released when the tracer stops."""
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, run_cli, wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def flags(events):
    """What the straggler and slowdown gauges must read after these events:
    the ranks the latest computation verdict names, until the job recovers;
    the job's latest slowdown or recovery. (A rank's own slowdown is not a
    straggler: every DDP rank slows with the slowest.)"""
    ranks, job = {}, 0
    for e in events:
        if e["kind"] in ("slowdown", "recovery") and e.get("scope") == "job":
            job = 1 if e["kind"] == "slowdown" else 0
            if e["kind"] == "recovery":
                ranks = {}
        elif e["kind"] == "diagnosis" and e["cause"] == "computation":
            ranks = {str(r): 1 for r in e["ranks"]}
    return ranks, job


def test_scrape_while_attached(ddp_job, tracer):
    job = ddp_job(2, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 2, 90, "the job to start")
    port = free_port()
    t = tracer([job.proc.pid], "-q", "--metrics", f"127.0.0.1:{port}")
    t.wait_attached(2)

    def ready():
        m = scrape(port)
        its = [v for (n, lab), v in m.items() if n == "greyhound_iteration_seconds"]
        return m if len(its) == 2 else None
    wait_for(ready, 90, "iteration metrics for both ranks", interval=0.5)

    # The gauges mirror the event stream. On this noisy 2-core machine a healthy
    # job can have a short false per-rank slowdown, so compare with what the
    # stream said rather than assume 0: scrape between two reads of the stream
    # that agree, the second after the stream's next flush.
    # The events that set the gauges, not just the state they leave: a
    # slowdown and its recovery both within the second would leave the
    # same state while the scrape saw the slowdown.
    def setters(events):
        return [e["time_ns"] for e in events if e["kind"] in ("slowdown", "recovery", "diagnosis")]

    def consistent():
        before = t.events()
        m = scrape(port)
        time.sleep(1.0)                  # > the stream's flush interval (0.5 s)
        return (m, flags(before)) if setters(t.events()) == setters(before) else None
    m, (ranks, job) = wait_for(consistent, 30, "a scrape between two quiet reads")
    for rank in ("0", "1"):
        assert 0 < m[("greyhound_iteration_seconds", (("rank", rank),))] < 5
        assert m[("greyhound_calls_total", (("fn", "gloo::allreduce"), ("rank", rank)))] > 0
        assert m[("greyhound_straggler", (("rank", rank),))] == ranks.get(rank, 0)
        assert m[("greyhound_iteration_duration_seconds_count", (("rank", rank),))] > 0
    info = [lab for (n, lab), v in m.items() if n == "greyhound_rank_info" and v == 1]
    assert sorted(dict(lab)["rank"] for lab in info) == ["0", "1"], info
    assert any(n == "greyhound_build_info" for n, _ in m)
    assert m[("greyhound_lost_records_total", ())] == 0
    assert m[("greyhound_slowdown_active", ())] == job
    assert ("greyhound_plan_seq", ()) in m
    # Counters grow between scrapes.
    key = ("greyhound_calls_total", (("fn", "gloo::allreduce"), ("rank", "0")))
    first = m[key]
    wait_for(lambda: scrape(port)[key] > first, 30, "more calls")
    assert f"127.0.0.1:{port}" in t.output()
    assert t.stop() == 0
    with socket.socket() as s:                     # nobody listens on the port any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (TIME_WAIT is fine)
        s.bind(("127.0.0.1", port))


def test_port_in_use_is_one_line(ddp_job):
    job = ddp_job(1, 0, go=False)
    wait_for(lambda: len(job.truth_records()) >= 1, 90, "the job to start")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run_cli("attach", str(job.proc.pid), "--metrics-port", str(s.getsockname()[1]),
                    "--duration", "2")
    assert r.returncode == 1 and "cannot listen" in r.stderr
    assert "Traceback" not in r.stderr
