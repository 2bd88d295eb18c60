"""The bandwidth floor fed synthetic gloo all-reduce records (the real
record layout, probe.records.CALL_DTYPE): a link too slow for any healthy
one is named from the calls alone, with no slowdown and no baseline; a
healthy job whose calls often wait for a peer is not; Greyhound's own
activity keeps it from looking."""
import random

import numpy as np

from greyhound_bpf.diagnosis.bandwidth import FLOOR_GBPS, BandwidthFloor
from greyhound_bpf.engine.activity import ActivityLog
from greyhound_bpf.probe.catalog import FIELD_SLOT0, load_catalog
from greyhound_bpf.probe.records import CALL_DTYPE

CAT = load_catalog()
ALLREDUCE = CAT.by_name["gloo::allreduce"]
BARRIER = CAT.by_name["gloo::barrier"]
FIELDS = [f for f, _ in ALLREDUCE.fields]


def calls(gbps_of, n, t0=0, period_ms=50.0, nbytes=1 << 20, seed=0, waits=0.0, fid=None):
    """n all-reduces per rank of `nbytes` (float32), one per period: each
    moves at its rank's `gbps_of[r]`, and with probability `waits` it also
    waits for a peer (up to 4x as long)."""
    rnd = random.Random(seed)
    recs = np.zeros(n * len(gbps_of), dtype=CALL_DTYPE)
    k = 0
    for i in range(n):
        for r, g in gbps_of.items():
            dur = nbytes * 8 / g * rnd.uniform(1.0, 1.1)
            if rnd.random() < waits:
                dur *= rnd.uniform(1.0, 4.0)
            rec = recs[k]
            rec["pid"], rec["tid"] = 100 + r, 100 + r
            rec["fn"] = ALLREDUCE.fid if fid is None else fid
            rec["start_ns"] = t0 + int(i * period_ms * 1e6)
            rec["dur_ns"] = int(dur)
            rec["args"][FIELD_SLOT0 + FIELDS.index("count")] = nbytes // 4
            rec["args"][FIELD_SLOT0 + FIELDS.index("elem_size")] = 4
            k += 1
    return recs


RANKS = {100: 0, 101: 1, 102: 2}


def feed(floor, recs, batch=30):
    out = []
    for i in range(0, len(recs), batch):
        out += floor.feed(recs[i:i + batch], RANKS)
    return out


def test_a_link_too_slow_for_any_healthy_one_is_named():
    slow = {r: 0.08 for r in range(3)}              # a 200 Mbit/s link in the ring
    got = feed(BandwidthFloor(CAT), calls(slow, 200))
    assert [(v.evidence, v.cause, v.ranks, v.details["method"]) for v in got] == \
        [("passive", "communication", (0, 1, 2), "bandwidth")]
    assert max(got[0].details["gbps"].values()) < FLOOR_GBPS
    # Said once while it lasts.
    floor = BandwidthFloor(CAT)
    assert len(feed(floor, calls(slow, 400))) == 1


def test_a_healthy_job_that_often_waits_for_a_peer_is_not():
    # Half its calls wait up to 4x as long for a peer: its fastest still
    # move at its links' speed (0.5 Gbit/s, the corpus's slowest healthy
    # runs on this busy 2-core VM read 0.47 at their 90th percentile).
    got = feed(BandwidthFloor(CAT), calls({r: 0.5 for r in range(3)}, 400, waits=0.5))
    assert got == []


def test_one_fast_rank_is_enough_to_clear_the_links_and_small_calls_say_nothing():
    got = feed(BandwidthFloor(CAT), calls({0: 0.08, 1: 0.08, 2: 1.0}, 300))
    assert got == []
    # 64 KiB calls are latency-bound: not read at all.
    floor = BandwidthFloor(CAT)
    assert feed(floor, calls({r: 0.01 for r in range(3)}, 300, nbytes=64 << 10)) == []
    assert floor.samples == {}
    # Nor calls whose size the probes do not read.
    assert feed(floor, calls({r: 0.01 for r in range(3)}, 300, fid=BARRIER.fid)) == []


def test_our_own_activity_keeps_it_from_looking():
    log = ActivityLog()
    log.update("w", "workers", 0, None)             # validation workers starting
    floor = BandwidthFloor(CAT, activity=log)
    slow = {r: 0.08 for r in range(3)}
    assert feed(floor, calls(slow, 200)) == []
    log.update("w", "workers", 0, int(2e9))
    # The window after it, clear of its load, is read again.
    assert len(feed(floor, calls(slow, 400, t0=int(3e9)))) == 1
