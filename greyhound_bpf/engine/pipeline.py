"""From call records to engine events, for a whole job.

One IterationEstimator and one SlowdownDetector per rank, and a job-level
SlowdownDetector fed with the leader's (the lowest rank's) iteration times.
Iterations that Greyhound's own activity overlapped (engine.activity) are
reported with `disturbed` and kept from the detectors. Part of JobAnalysis,
which `attach`, `replay` and the cluster controller all run; event times are
the data's own times, which makes a replay deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..probe.catalog import FIELD_SLOT0, Catalog
from .activity import ActivityLog
from .detector import MIN_PROBABILITY, SLOWDOWN_THRESHOLD, ChangePoint, SlowdownDetector
from .iterations import IterationEstimator, IterationRecord, PatternChange


# The v1 flags of two kinds of disturbance, still written beside `disturbed`.
LEGACY_FLAG = {"pause": "paused", "attach": "settling"}


class FedLog:
    """(iteration index, start_ns) of each detector input, by input position,
    the latest `keep` only: a detector never looks further back
    (SlowdownDetector.MAX_KEPT), and a job runs for days."""

    def __init__(self, keep: int = 2 * SlowdownDetector.MAX_KEPT):
        self.keep, self.base, self.items = keep, 0, []

    def append(self, item: tuple[int, int]) -> None:
        self.items.append(item)
        if len(self.items) > 2 * self.keep:
            drop = len(self.items) - self.keep
            del self.items[:drop]
            self.base += drop

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.items[i - self.base]

    def __len__(self) -> int:
        return self.base + len(self.items)


@dataclass
class RankState:
    key: int                       # pid (live) or rank (replay)
    rank: int | None
    estimator: IterationEstimator
    detector: SlowdownDetector
    types: dict = field(default_factory=dict)   # (fn, comm) -> call type id
    last: IterationRecord | None = None
    fed: FedLog = field(default_factory=FedLog)  # (iteration index, start_ns) per detector input
    period: int = 0                # the pattern's period of its latest iteration


def _order(r: RankState) -> tuple:
    """Who leads: the lowest rank (processes without one last)."""
    return (r.rank is None, r.rank or 0, r.key)


class JobPipeline:
    def __init__(self, catalog: Catalog, *, threshold: float = SLOWDOWN_THRESHOLD,
                 min_probability: float = MIN_PROBABILITY, estimator_args: dict | None = None,
                 activity: ActivityLog | None = None):
        self.catalog = catalog
        self.threshold = threshold
        self.min_probability = min_probability
        self.estimator_args = estimator_args or {}
        self.ranks: dict[int, RankState] = {}
        self.job_detector = SlowdownDetector(scope="job", threshold=threshold,
                                             min_probability=min_probability)
        self._job_fed = FedLog()                    # leader's (index, start_ns) per job input
        self._lead: RankState | None = None         # cached _leader()
        # Greyhound's own activity: iterations overlapping it are reported
        # but not fed to the detectors (our load is no slowdown of the job's).
        self.activity = activity if activity is not None else ActivityLog()
        n = len(catalog.functions)
        self._comm_slot = np.full(n, -1, dtype=np.int64)
        self._count_slot = np.full(n, -1, dtype=np.int64)
        self._blocking = np.zeros(n, dtype=bool)
        self._p2p = np.zeros(n, dtype=bool)
        self._coll = np.zeros(n, dtype=bool)
        for fn in catalog.functions:
            if "comm" in fn.args:
                self._comm_slot[fn.fid] = fn.args.index("comm")
            if "count" in fn.args:
                self._count_slot[fn.fid] = fn.args.index("count")
            names = [f for f, _ in fn.fields]
            if "count" in names:
                self._count_slot[fn.fid] = FIELD_SLOT0 + names.index("count")
            self._blocking[fn.fid] = fn.blocking
            self._p2p[fn.fid] = fn.kind == "p2p"
            self._coll[fn.fid] = fn.kind == "collective"

    def add_rank(self, key: int, rank: int | None) -> None:
        if key not in self.ranks:
            est = IterationEstimator(rank=rank, **self.estimator_args)
            # Whether the other ranks repeat the same point-to-point exchange
            # (IterationEstimator: peers' collectives are not a pipeline step's).
            est.peers = partial(self._others, key, "rhythm")
            # Whether they find the same period of one call type's gaps.
            est.offers = partial(self._others, key, "offer")
            self.ranks[key] = RankState(
                key, rank, est, SlowdownDetector(scope="rank", threshold=self.threshold,
                                                 min_probability=self.min_probability))

    def _others(self, key: int, what: str) -> list[int | None]:
        """What every other rank's estimator says of itself (`rhythm`, `offer`)."""
        return [getattr(o.estimator, what) for k, o in self.ranks.items() if k != key]

    def retire(self, key: int) -> None:
        """A rank exited (or its node's agent was lost): it leads and counts
        in the job's median again only once it reports a new iteration."""
        if key in self.ranks:
            self.ranks[key].last = None
            if self._lead is self.ranks[key]:
                self._lead = None            # choose again among the others

    # -- input ---------------------------------------------------------------------

    def feed_records(self, recs: np.ndarray, rank_of: dict[int, int | None],
                     mono_to_wall: int = 0) -> list[tuple[str, dict, int]]:
        """Tracer batches (records.CALL_DTYPE). Returns (kind, fields, time_ns)."""
        out = []
        if len(recs) == 0:
            return out
        for pid in np.unique(recs["pid"]).tolist():
            sel = recs[recs["pid"] == pid]
            fn = sel["fn"].astype(np.int64)
            rows = np.arange(len(sel))
            slot = self._comm_slot[fn]
            comm = np.where(slot >= 0, sel["args"][rows, np.maximum(slot, 0)], 0)
            cslot = self._count_slot[fn]
            count = np.where(cslot >= 0, sel["args"][rows, np.maximum(cslot, 0)], 0)
            self.add_rank(pid, rank_of.get(pid))
            out += self.feed_calls(pid, fn, comm.astype(np.uint64),
                                   sel["start_ns"].astype(np.int64) + mono_to_wall,
                                   sel["dur_ns"].astype(np.int64), count.astype(np.uint64))
        return out

    def feed_calls(self, key: int, fn: np.ndarray, comm: np.ndarray, start_ns: np.ndarray,
                   dur_ns: np.ndarray, count: np.ndarray | None = None
                   ) -> list[tuple[str, dict, int]]:
        """One rank's calls. A call's type is (function, communicator, element
        count): DDP's gloo buckets differ only by their size."""
        rs = self.ranks[key]
        if count is None:
            count = np.zeros(len(fn), dtype=np.uint64)
        order = np.argsort(start_ns, kind="stable")
        fn, comm, start_ns, dur_ns = fn[order], comm[order], start_ns[order], dur_ns[order]
        count = count[order]
        with np.errstate(over="ignore"):
            keys = (fn.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                    ^ comm.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
                    ^ count.astype(np.uint64) * np.uint64(0x165667B19E3779F9))
        uniq, inv = np.unique(keys, return_inverse=True)
        lut = np.array([rs.types.setdefault(int(k), len(rs.types)) for k in uniq.tolist()],
                       dtype=np.int64)
        types = lut[inv]
        out = []
        for item in rs.estimator.feed(types, start_ns, dur_ns, self._blocking[fn],
                                      self._p2p[fn], self._coll[fn]):
            if isinstance(item, PatternChange):
                out.append(("pattern", item.fields(), item.at_ns))
            else:
                out += self._iteration(rs, item)
        return out

    def _new_unit(self, rs: RankState) -> None:
        """The rank's pattern has another period now: its iterations' times
        are of another unit, and a level read in the old one is no
        reference (post-local SGD: one step per iteration under DDP, then
        the 4 steps between two averagings, a "slowdown" of x1.3 that the
        job's own log, step by step, read faster). Its detector starts
        again, and the job's if it leads; one in a slowdown keeps its
        reference, whose recovery the episode waits for."""
        if rs.detector.state != "slow":
            rs.detector.reset()
            rs.fed = FedLog()
        if self._leader() is rs and self.job_detector.state != "slow":
            self.job_detector.reset()
            self._job_fed = FedLog()

    def feed_iterations(self, key: int, items: list[IterationRecord]
                        ) -> list[tuple[str, dict, int]]:
        """One rank's iterations, found elsewhere (a node's agent found them
        in its calls): the same chain after the estimator."""
        rs = self.ranks[key]
        out = []
        for item in sorted(items, key=lambda it: it.start_ns):
            out += self._iteration(rs, item)
        return out

    def _iteration(self, rs: RankState, item: IterationRecord) -> list[tuple[str, dict, int]]:
        # Read from the iterations, not from the `pattern` event: a node's
        # agent forwards only its iterations to the controller.
        if item.period and rs.period and item.period != rs.period:
            self._new_unit(rs)
        rs.period = item.period or rs.period
        f = item.fields()
        span = self.activity.disturbing(item.start_ns, item.start_ns + item.dur_ns)
        if span is not None:
            # Reported, but not the job's speed: kept from the detectors.
            f["disturbed"] = span.what
            legacy = LEGACY_FLAG.get(span.what)
            if legacy:
                f[legacy] = True
            return [("iteration", f, item.start_ns + item.dur_ns)]
        out = [("iteration", f, item.start_ns + item.dur_ns)]
        if rs.last is None and self._lead is not None and _order(rs) < _order(self._lead):
            self._lead = rs                  # a lower rank reports: it leads
        rs.last = item
        rs.fed.append((item.index, item.start_ns))
        cp = rs.detector.update(item.dur_ns / 1e6)
        if cp:
            out.append(self._change(cp, rs.rank, item, rs.fed))
        return out + self._job_step(rs, item)

    # -- job level ------------------------------------------------------------------

    def _leader(self) -> RankState | None:
        """The lowest rank with an iteration (chosen again only when a rank
        starts or stops reporting: a job of thousands of ranks asks this for
        every iteration of every rank)."""
        if self._lead is None:
            self._lead = min((r for r in self.ranks.values() if r.last is not None),
                             key=_order, default=None)
        return self._lead

    def _job_step(self, rs: RankState, item: IterationRecord) -> list:
        if self._leader() is not rs:
            return []
        # The ranks are held in step by their collectives, so the leader's
        # start-to-start time is the job's: what its own log reads. (The
        # median of every rank's latest time, used before, mixed in other
        # ranks' previous iterations: on a busy host it read a long
        # iteration as the short one before it, up to 25% under the wall
        # clock for a while, and the end of that bias was a "slowdown".)
        self._job_fed.append((item.index, item.start_ns))
        cp = self.job_detector.update(item.dur_ns / 1e6)
        return [self._change(cp, None, item, self._job_fed)] if cp else []

    def _change(self, cp: ChangePoint, rank: int | None, item: IterationRecord, fed: FedLog):
        # Detector positions -> the iteration indices of `iteration` events,
        # and the wall-clock start of the first iteration of the new level.
        fields = cp.fields()
        (fields["index"], fields["onset_ns"]), fields["detected_index"] = \
            fed[cp.index], fed[cp.detected_at][0]
        if cp.baseline_at >= fed.base:
            fields["baseline_index"], fields["baseline_ns"] = fed[cp.baseline_at]
        if cp.scope == "rank":
            fields["rank"] = rank
        return (cp.kind, fields, item.start_ns + item.dur_ns)

    # -- state for summaries -------------------------------------------------------

    @property
    def job_iterations(self) -> int:
        """Job-level iterations measured so far (speed samples of the leader)."""
        return len(self._job_fed)

    def rank_view(self, key: int) -> dict:
        rs = self.ranks.get(key)
        if rs is None:
            return {"state": "-", "iter_ms": None, "comm_frac": None, "period": None}
        est = rs.estimator
        state = est.state if est.state != "locked" else rs.detector.state
        last = rs.last
        return {"state": state.replace("_", " "),
                "iter_ms": last.dur_ns / 1e6 if last else None,
                "comm_frac": last.comm_ns / last.dur_ns if last and last.dur_ns else None,
                "period": est.period}
