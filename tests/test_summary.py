"""The bcc-style text summary: per-rank aggregation of record batches, under
80 columns, with untrusted process names sanitised."""
import numpy as np

from greyhound_bpf.probe.catalog import load_catalog
from greyhound_bpf.probe.records import CALL_DTYPE
from greyhound_bpf.output.summary import CallStats, safe

CAT = load_catalog()
AR = CAT.by_name["gloo::allreduce"].fid
BC = CAT.by_name["gloo::broadcast"].fid


def batch(rows):
    a = np.zeros(len(rows), dtype=CALL_DTYPE)
    for i, (pid, fn, dur) in enumerate(rows):
        a[i]["pid"], a[i]["fn"], a[i]["dur_ns"] = pid, fn, dur
    return a


def test_aggregation_per_rank_and_function():
    s = CallStats(CAT)
    s.add_target(100, 0, "python")
    s.add_target(200, 1, "python")
    s.add(batch([(100, AR, 1_000_000), (100, AR, 3_000_000), (200, BC, 5_000_000)]))
    s.add(batch([(100, AR, 2_000_000)]))
    ar = s.ranks[100].fns[AR]
    assert (ar.count, ar.total_ns, ar.max_ns) == (3, 6_000_000, 3_000_000)
    assert s.ranks[200].fns[BC].count == 1
    text = s.format_interval()
    lines = text.splitlines()
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines)
    assert "gloo::allreduce" in lines[1] and "2.000" in lines[1]     # mean of 3 calls
    # The interval resets; totals stay.
    assert " 0.0" in s.format_interval().splitlines()[1]
    # The engine's view of a rank: iteration time, comm share, state.
    view = s.format_interval(lambda pid: {"state": "warming up", "iter_ms": 31.25,
                                          "comm_frac": 0.4})
    assert "31.25" in view and "40%" in view and "warming up" in view
    assert all(len(line) <= 80 for line in view.splitlines())
    final = s.format_final(lost=7, delivered=4, elapsed_s=2.0)
    assert "4 calls traced" in final and "7 lost" in final
    assert all(len(line) <= 80 for line in final.splitlines())


def test_untrusted_names_are_sanitised():
    assert safe("evil\x1b[2Jname\n", 32) == "evil?[2Jname?"
    assert safe("x" * 100, 10) == "x" * 10
