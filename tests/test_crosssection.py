"""The cross-sectional straggler rule fed synthetic iteration events: the
ranks compared with each other, per unit of work where the trainer
announced an uneven split."""
import random

from greyhound_bpf.diagnosis.crosssection import CrossSection


def feed(xs, iterations, per_mb, microbatches, other_ms=2.0, t0=0, seed=0):
    """Data-parallel iterations: each rank computes its micro-batches at
    its own speed (`per_mb[r]` ms each), then all wait in the all-reduce
    for the slowest. Returns the verdicts and the next start time."""
    rnd = random.Random(seed)
    out, t = [], t0
    for i in range(iterations):
        comp = {r: microbatches[r] * per_mb[r] * rnd.uniform(0.97, 1.03) for r in per_mb}
        dur = max(comp.values()) + other_ms
        for r in sorted(per_mb):
            out += xs.observe({"kind": "iteration", "rank": r, "index": i, "start_ns": t,
                               "dur_ns": int(dur * 1e6), "compute_ns": int(comp[r] * 1e6),
                               "comm_ns": int((dur - comp[r]) * 1e6)})
        t += int(dur * 1e6)
    return out, t


def test_a_slow_rank_at_an_even_split_is_named():
    xs = CrossSection()
    got, _ = feed(xs, 200, {0: 1.0, 1: 2.5, 2: 1.0, 3: 1.0}, {r: 8 for r in range(4)})
    assert [(v.cause, v.ranks) for v in got] == [("computation", (1,))]


def test_a_rank_given_more_work_by_a_plan_is_no_straggler():
    # After a fault on rank 1 is lifted, the plan still gives rank 0 12 of
    # 16 micro-batches: rank 0 computes longest and rank 1 waits for it.
    # Per unit of work the two are alike: no verdict.
    split = {0: 12, 1: 4}
    xs = CrossSection()
    xs.work(split)
    got, _ = feed(xs, 300, {0: 1.0, 1: 1.0}, split)
    assert got == []
    # Without the split the same events name rank 0: the rule needs it.
    got, _ = feed(CrossSection(), 300, {0: 1.0, 1: 1.0}, split)
    assert [v.ranks for v in got] == [(0,)]


def test_a_new_fault_under_a_plan_is_named_per_unit_of_work():
    # Rank 1's plan is in force (it got 5 of 16) and rank 0 turns slow.
    split = {0: 11, 1: 5}
    xs = CrossSection()
    xs.work(split)
    got, _ = feed(xs, 300, {0: 3.0, 1: 1.0}, split)
    assert [(v.ranks, "even share" in v.reason) for v in got] == [((0,), True)]
    assert got[0].details["work"] == {"0": 11, "1": 5}


def test_a_new_split_starts_the_window_anew_and_an_even_one_changes_nothing():
    xs = CrossSection()
    feed(xs, 40, {0: 1.0, 1: 1.0}, {0: 8, 1: 8})
    assert xs.rows
    xs.work({0: 8, 1: 8})                  # even: scales nothing, keeps the window
    assert xs.rows
    xs.work({0: 10, 1: 6})
    assert not xs.rows
