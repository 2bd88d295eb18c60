"""Live communication slowdown: a 4-rank gloo DDP job whose ranks sit in
their own network namespaces; a 200mbit tbf rate limit (LinkRate, what
`greyhound-trace inject link` runs) on rank 1's link. Passive diagnosis
says `communication` (never `computation`); validation, run by attach
after that verdict, names rank 1's link; lifting the limit gives a
recovery; nothing is left."""
import subprocess
import time

import pytest

from conftest import GREYHOUND, ROOT, read_events, wait_for
from greyhound_bpf.inject import LinkRate
from netbed import NetBed

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

TRAIN = ("--microbatches", "2", "--mb-size", "64", "--hidden", "512", "--layers", "4",
         "--bucket-mb", "1")


def test_link_slowdown_is_communication(tracer, tmp_path):
    truth = tmp_path / "truth.jsonl"
    bed = NetBed(4)
    with bed:
        pids = bed.start_ranks(truth, *TRAIN)
        wait_for(lambda: len(read_events(truth)) >= 40, 120, "the job to train")
        t = tracer(pids, "-q")
        t.wait_attached(4)
        t.healthy_baseline(150)
        start = time.time_ns()
        # 200mbit: collectives take 3-4x as long, well over the passive bar
        # (diagnosis.COMM_RATIO); 400mbit read 1.9-2.7x, where a busy 2-core
        # host's own episodes reach 1.7x (then only validation names it).
        # In this process (LinkRate, what `inject link` runs): with the CLI,
        # its start-up (about a second of CPU on this 2-core host) comes at
        # the fault's onset; once the job slowed x1.58 a second before the
        # limit's x2.61, one rank's compute grew 20 ms, and the passive
        # verdict read computation. `inject link` is tested in test_inject
        # and below.
        named = lambda ev: [e for e in t.events("diagnosis") if e["time_ns"] > start  # noqa: E731
                            and e["evidence"] == ev and e["cause"] != "unknown"]
        with LinkRate(bed.host_dev(1), "200mbit"):      # lifted once named
            diag = wait_for(lambda: named("passive"), 60, "a passive diagnosis",
                            interval=0.5, why=t.story)[0]
            val = wait_for(lambda: named("validation"), 60, "a validated diagnosis",
                           interval=0.5, why=t.story)[0]
        wait_for(lambda: [e for e in t.events("recovery") if e["scope"] == "job"
                          and e["time_ns"] > start], 90, "a recovery after the lift",
                 interval=0.5, why=t.story)
        assert t.stop() == 0
        assert diag["cause"] == "communication", t.events("diagnosis")
        assert (val["cause"], val["link"], val["ranks"]) == ("communication", "rank 1", [1])
        assert val["details"]["paused_s"] <= 5
        assert not [e for e in t.events("diagnosis") if e["cause"] == "computation"]
        assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", bed.host_dev(1)],
                                           capture_output=True, text=True).stdout
    assert bed.leftovers() == []


def test_a_link_already_slow_at_attach_is_named(tracer, tmp_path):
    """The link is slow before Greyhound comes (no slowdown to see, every
    rank waiting alike): the calls' own bandwidth names the communicator
    passively (diagnosis.bandwidth), validation names rank 1's link. First
    a healthy attach of the same job: nothing named."""
    truth = tmp_path / "truth.jsonl"
    bed = NetBed(3, prefix="ghb", subnet="10.78.0")
    with bed:
        pids = bed.start_ranks(truth, *TRAIN, port=29733)
        wait_for(lambda: len(read_events(truth)) >= 40, 120, "the job to train")
        healthy = tracer(pids, "-q", name="healthy")
        healthy.wait_attached(3)
        wait_for(lambda: min(len(healthy.measured(r)) for r in range(3)) >= 60, 90,
                 "60 measured iterations per rank", interval=0.5)
        assert [e for e in healthy.events("diagnosis") if e["cause"] != "unknown"] == [], \
            healthy.story()
        assert healthy.stop() == 0
        inj = subprocess.Popen([*GREYHOUND, "inject", "link", "--dev", bed.host_dev(1),
                                "--rate", "200mbit", "--for", "120"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(5)                                 # slow before we come
            t = tracer(pids, "-q", name="slow")
            t.wait_attached(3)
            attach_ns = t.events("attach")[0]["time_ns"]
            named = lambda ev: [e for e in t.events("diagnosis")  # noqa: E731
                                if e["evidence"] == ev and e["cause"] != "unknown"]
            diag = wait_for(lambda: named("passive"), 30, "a passive verdict", interval=0.5,
                            why=t.story)[0]
            val = wait_for(lambda: named("validation"), 60, "a validated verdict",
                           interval=0.5, why=t.story)[0]
            assert t.stop() == 0
        finally:
            inj.send_signal(2)
            out, _ = inj.communicate(timeout=60)
        assert "undone" in out, out
        print(f"link slow at attach: passive after {(diag['time_ns'] - attach_ns) / 1e9:.1f} s"
              f" ({diag['reason']}), validated after {(val['time_ns'] - attach_ns) / 1e9:.1f} s")
        assert (diag["cause"], diag["ranks"], diag["details"]["method"]) == \
            ("communication", [0, 1, 2], "bandwidth"), t.story()
        assert (val["cause"], val["link"], val["ranks"]) == ("communication", "rank 1", [1]), \
            t.story()
        assert not [e for e in t.events("diagnosis") if e["cause"] == "computation"]
    assert bed.leftovers() == []
