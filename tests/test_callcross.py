"""The cross-section call by call (diagnosis/callcross.py) fed synthetic
gloo all-reduce records in the real record layout (probe.records.CALL_DTYPE):
a slow job with few collectives an iteration gets its straggler named from
the calls alone, and so does a dense one before every rank's calls locked
into iterations; a healthy one, one long stall, subgroups, a job with many
collectives an iteration once its iterations are counted, Greyhound's own
activity and a plan's uneven split get nothing."""
import random

import numpy as np

from greyhound_bpf.diagnosis.callcross import CallCross
from greyhound_bpf.engine.activity import ActivityLog
from greyhound_bpf.probe.catalog import load_catalog
from greyhound_bpf.probe.records import CALL_DTYPE

CAT = load_catalog()
ALLREDUCE = CAT.by_name["gloo::allreduce"]
S = 1_000_000_000


def job(compute_ms, iterations, calls=3, jitter=0.1, seed=0, stall=None, groups=None, t0=0,
        split=None):
    """Records of a data-parallel job: every iteration each rank computes
    its `compute_ms[r]` (x a jitter), split over `calls` all-reduces (most of
    it before the first: forward and backward, the rest between buckets;
    or as `split` says), and each all-reduce ends 20 ms after its last rank
    arrives. `stall`: (rank, iteration, ms) more compute once, or a list of
    them. `groups`: rank sets that all-reduce among themselves only."""
    rnd = random.Random(seed)
    ranks = sorted(compute_ms)
    groups = groups or [ranks]
    stalls = [stall] if isinstance(stall, tuple) else stall or []
    if split is None:
        split = [0.8] + [0.2 / (calls - 1)] * (calls - 1) if calls > 1 else [1.0]
    free = dict.fromkeys(ranks, t0)          # when each rank left its last call
    out = []
    for i in range(iterations):
        for share in split:
            arrive = {}
            for r in ranks:
                c = compute_ms[r] * share * rnd.uniform(1 - jitter, 1 + jitter)
                c += sum(x[2] for x in stalls if x[:2] == (r, i) and share == split[0])
                arrive[r] = free[r] + int(c * 1e6)
            for g in groups:
                done = max(arrive[r] for r in g) + 20_000_000
                for r in g:
                    end = done + rnd.randint(0, 2_000_000)
                    out.append((100 + r, arrive[r], end - arrive[r]))
                    free[r] = end
    recs = np.zeros(len(out), dtype=CALL_DTYPE)
    for k, (pid, start, dur) in enumerate(sorted(out, key=lambda x: x[1] + x[2])):
        recs[k]["pid"], recs[k]["tid"], recs[k]["fn"] = pid, pid, ALLREDUCE.fid
        recs[k]["start_ns"], recs[k]["dur_ns"] = start, dur
    return recs


def feed(cc, recs, every_ns=S // 2, ranks=None):
    """In batches as the ring buffer is read: every half second, the calls
    that ended in it."""
    ranks = ranks or {100 + r: r for r in range(8)}
    ends = recs["start_ns"] + recs["dur_ns"]
    out, t = [], every_ns
    while len(recs):
        m = ends <= t
        if m.any():
            out += cc.feed(recs[m], ranks)
        recs, ends, t = recs[~m], ends[~m], t + every_ns
    return out


def test_a_slow_sparse_jobs_straggler_is_named_from_its_calls_within_seconds():
    # A second an iteration healthy, 3 all-reduces each (the checkpointed
    # ViT's shape); rank 2 at a third of its speed from the start.
    recs = job({0: 1000, 1: 1050, 2: 3000}, 12)
    got = feed(CallCross(CAT), recs)
    assert [(v.evidence, v.cause, v.ranks, v.details["method"], v.details["calls"])
            for v in got] == [("passive", "computation", (2,), "cross-section", True)]
    d = got[0].details
    assert d["last_share"] >= 0.8 and d["excess_ms"] > 0.3 * d["span_ms"]
    # Named within the goal's 15 s of the job's first call (its pace known
    # over 6 s, then two looks), where counting its iterations takes 16
    # calls, 16 s at 3 s an iteration, and a window of them after that.
    assert d["at_ns"] - int(recs["start_ns"].min()) < 15 * S, d["at_ns"] / S
    # Said once while it lasts.
    assert len(feed(CallCross(CAT), job({0: 1000, 1: 1050, 2: 3000}, 40))) == 1


def test_a_healthy_sparse_job_with_a_busy_rank_and_one_long_stall_gets_nothing():
    cc = CallCross(CAT)
    # Rank 0 does 10% more (logging), every rank jitters 20%, and rank 1
    # stalls 5 s once (a checkpoint).
    recs = job({0: 1100, 1: 1000, 2: 1000}, 150, jitter=0.2, seed=3, stall=(1, 40, 5000))
    assert feed(cc, recs) == []
    assert cc.last is not None and cc.last["collectives"] >= 5      # it did look
    # Rank 0 does 30% more, last at nearly every collective, and it is the
    # one that stalls: that collective is left out (its largest excess),
    # and 30% more is no straggler.
    recs = job({0: 1300, 1: 1000, 2: 1000}, 60, jitter=0.05, seed=4, stall=(0, 20, 5000))
    assert feed(CallCross(CAT), recs) == []


def test_a_job_with_many_collectives_an_iteration_is_left_to_the_iterations():
    # 30 all-reduces an iteration at 300 ms: the iterations' looks name it
    # within seconds; this look does not run.
    cc = CallCross(CAT)
    assert feed(cc, job({0: 300, 1: 300, 2: 900}, 40, calls=30)) == []
    assert cc.last is None


def test_a_dense_job_not_every_rank_has_locked_on_is_looked_at_call_by_call():
    # 10 all-reduces an iteration, too many over SPAN_S for this look once
    # the iterations are counted; before every rank's calls locked into
    # iterations (steps at an irregular rhythm lock late) no iteration
    # look can run, so this one does, and names the straggler from the
    # calls. A healthy dense job, one rank 10% busier and a stall, still
    # gets nothing.
    slow = job({0: 300, 1: 300, 2: 900}, 40, calls=10)
    assert feed(CallCross(CAT), slow) == []
    cc = CallCross(CAT)
    cc.locked({0: False, 1: False, 2: False})
    got = feed(cc, slow)
    assert [(v.cause, v.ranks, v.details["calls"]) for v in got] == [
        ("computation", (2,), True)]
    assert got[0].details["at_ns"] < 15 * S
    cc = CallCross(CAT)
    cc.locked({0: False, 1: False, 2: False})
    assert feed(cc, job({0: 330, 1: 300, 2: 300}, 150, calls=10, jitter=0.2, seed=5,
                        stall=(1, 50, 3000))) == []
    assert cc.last is not None and cc.last["collectives"] >= 24     # it did look


def fed_with_iterations(cc, recs, covered: float):
    """`feed`, every rank locked, each half second's calls after the
    iterations that ended in it: iterations covering `covered` of each
    second (a pattern locked on one length of a cycle counts only some)."""
    cc.locked({0: True, 1: True, 2: True})
    ends = recs["start_ns"] + recs["dur_ns"]
    out, t = [], S // 2
    while len(recs):
        if t % S == 0:
            for r in range(3):
                cc.iteration(r, t - S, t - S + int(covered * S))
        m = ends <= t
        if m.any():
            out += cc.feed(recs[m], {100 + r: r for r in range(3)})
        recs, ends, t = recs[~m], ends[~m], t + S // 2
    return out


def test_a_dense_job_whose_iterations_count_little_of_its_time_is_looked_at_call_by_call():
    # Every rank locked, but on one length of an irregular cycle: its
    # iterations cover 60% of the time (the drift-triggered averaging's
    # tries), too few for the iterations' looks, so this one runs; where
    # they cover it all, it does not.
    slow = job({0: 300, 1: 300, 2: 900}, 40, calls=10)
    assert [v.ranks for v in fed_with_iterations(CallCross(CAT), slow, 0.6)] == [(2,)]
    assert fed_with_iterations(CallCross(CAT), slow, 1.0) == []


def test_subgroups_are_not_compared():
    # Two pairs, each all-reducing on its own (a mesh's replicas): no
    # collective holds every rank, so nothing is matched, whoever is slow.
    cc = CallCross(CAT)
    recs = job({0: 1000, 1: 1000, 2: 1000, 3: 3000}, 20, groups=[[0, 1], [2, 3]])
    assert feed(cc, recs) == [] and cc.last is None


def test_our_own_activity_and_an_uneven_split_keep_it_quiet():
    log = ActivityLog()
    log.update("p", "pause", 0, None)                # a validation pause that lasts
    cc = CallCross(CAT, activity=log)
    assert feed(cc, job({0: 1000, 1: 1000, 2: 3000}, 12)) == []
    log.update("p", "pause", 0, 1)                    # over: the same job is named
    assert len(feed(CallCross(CAT, activity=log), job({0: 1000, 1: 1000, 2: 3000}, 12))) == 1
    cc = CallCross(CAT)
    cc.work({0: 6, 1: 6, 2: 4})                       # a plan in force
    assert feed(cc, job({0: 1000, 1: 1000, 2: 3000}, 12)) == []
    cc.work({0: 5, 1: 5, 2: 5})                       # back to even
    assert len(feed(cc, job({0: 1000, 1: 1000, 2: 3000}, 12, t0=60 * S))) == 1


# fairseq's legacy trainer (examples/fairseq_legacy.py): its compute, then
# an all-reduce of the logging statistics and at once one of the gradients.
BACK_TO_BACK = {"calls": 2, "split": [1.0, 0.0]}


def test_collectives_back_to_back_are_judged_where_compute_comes_before():
    # 1.4 s an update healthy, rank 1 at a third of its speed from +20 s
    # (its excess half the job's time, under the strong look's bar): who
    # arrives last at the gradients' all-reduce is chance, at the
    # statistics' it is the straggler.
    healthy = job({0: 1400, 1: 1400, 2: 1400}, 14, **BACK_TO_BACK, jitter=0.2, seed=5)
    t0 = int((healthy["start_ns"] + healthy["dur_ns"]).max())
    slow = job({0: 1400, 1: 2800, 2: 1400}, 14, **BACK_TO_BACK, jitter=0.2, seed=6, t0=t0)
    recs = np.concatenate([healthy, slow])
    cc = CallCross(CAT)
    got = feed(cc, recs)
    assert [(v.cause, v.ranks, v.details["strong"]) for v in got] == [
        ("computation", (1,), False)], cc.last
    assert got[0].details["last_share"] == 1.0
    assert got[0].details["at_ns"] - t0 < 15 * S, (got[0].details["at_ns"] - t0) / S
    # The same shape healthy, with rank 0 doing 30% more and each rank
    # jittering 20%: nothing.
    cc = CallCross(CAT)
    assert feed(cc, job({0: 1800, 1: 1400, 2: 1400}, 60, **BACK_TO_BACK, jitter=0.2, seed=7)) == []
    assert cc.last is not None


def test_overwhelming_evidence_is_named_on_one_look_over_two_updates():
    # Already slow at attach: rank 2 at 6.8 s an update where the others
    # take 1.4 s and then wait for it. Two updates (five whole collectives,
    # the largest excess left out) name it on one look as the third update's
    # collectives end (the first one's compute began before the first call
    # seen), where six collectives and a second look take two updates more.
    # (Rank 0 leaves the third update's last all-reduce a microsecond after
    # the others: that collective counts, as the fifth.)
    recs = job({0: 1400, 1: 1400, 2: 6800}, 10, **BACK_TO_BACK, seed=8)
    got = feed(CallCross(CAT), recs)
    assert [(v.ranks, v.details["strong"], v.details["collectives"]) for v in got] == [
        ((2,), True, 4)]
    ends = np.sort(recs["start_ns"] + recs["dur_ns"])
    assert ends[2 * 2 * 3 - 1] < got[0].details["at_ns"] <= ends[3 * 2 * 3 - 1]  # updates 3
    # A healthy job of that shape with two long stalls in a row, on two
    # ranks, or one on one rank: nothing.
    for stalls in ([(1, 5, 5000), (2, 6, 5000)], [(1, 5, 5000)]):
        cc = CallCross(CAT)
        assert feed(cc, job({0: 1400, 1: 1400, 2: 1400}, 12, **BACK_TO_BACK, seed=9,
                            stall=stalls)) == []
        assert cc.last is not None
