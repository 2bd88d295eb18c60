"""Collectives too slow for any healthy link: a passive communication
verdict with no change point and no baseline.

A link already slow when Greyhound attaches shows no slowdown (there is no
"before"), and every rank of a ring waits alike for it, so neither the
change-point rules nor the cross-section (one rank computing longer) see
it. What the calls still show is how fast the bytes move: a blocking
collective whose size the probes read (gloo's all-reduce: count x element
size) moves at most bytes / duration. Waiting for a peer only makes a call
slower, so the *fastest* of a rank's large calls bound its links from below:
when the fastest QUANTILE of every rank's calls move under FLOOR_GBPS, some
link of theirs is that slow, whatever the job did before. That names the
communicator (`communication`, `details.method: "bandwidth"`); validation's
p2p edges then name the link.

Only blocking calls whose size the catalog reads count (gloo's
all-reduce): an NCCL call only enqueues, and its duration says nothing of
how fast the bytes move (README, "Honest semantics").

Fed call records (probe.records.CALL_DTYPE) like the topology; pure.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..engine.activity import ActivityLog
from ..probe.catalog import FIELD_SLOT0, Catalog
from .verdict import Diagnosis

# Set on the scenario corpus (its tune and held-out parts alike, the only
# data there is): the fastest 5% of >= 256 KiB all-reduces moved 0.08-0.10
# Gbit/s under a 200 Mbit/s link (link-demo4-r1, heldout-link-user3-r2; 0.12
# live, tests/test_link_live), and >= 0.28 Gbit/s in every other run,
# healthy or under a CPU quota that saturates this 2-core VM (0.47-9.2
# healthy). The floor is their geometric middle, 1.5x from either. A
# datacenter link this slow (a NIC renegotiated to 100 Mbit/s, a lane down
# to almost nothing) is a fault.
FLOOR_GBPS = 0.18
QUANTILE = 0.95
# Smaller calls are latency-bound: their duration says little of bandwidth.
MIN_BYTES = 256 * 1024
MIN_CALLS = 30        # per rank, in the window
WINDOW_S = 10.0
HOLD_S = 3.0          # under the floor on every rank this long before a verdict
CLEAR = 2.0           # back above CLEAR x the floor: a later fall is a new fault
QUIET_NS = 2_000_000_000   # after Greyhound's own activity (its load slows calls)


class BandwidthFloor:
    def __init__(self, catalog: Catalog, topology=None, activity: ActivityLog | None = None,
                 floor_gbps: float = FLOOR_GBPS, quantile: float = QUANTILE,
                 min_calls: int = MIN_CALLS, window_s: float = WINDOW_S,
                 hold_s: float = HOLD_S):
        self.floor_gbps, self.quantile, self.min_calls = floor_gbps, quantile, min_calls
        self.window_ns, self.hold_ns = int(window_s * 1e9), int(hold_s * 1e9)
        self.topology = topology
        self.activity = activity if activity is not None else ActivityLog()
        n = len(catalog.functions)
        # Per function: the argument slots of its element count and size.
        self._count = np.full(n, -1, dtype=np.int64)
        self._size = np.full(n, -1, dtype=np.int64)
        for fn in catalog.functions:
            names = [f for f, _ in fn.fields]
            if fn.blocking and "count" in names and "elem_size" in names:
                self._count[fn.fid] = FIELD_SLOT0 + names.index("count")
                self._size[fn.fid] = FIELD_SLOT0 + names.index("elem_size")
        self.samples: dict[int, deque] = {}       # rank -> (end_ns, Gbit/s)
        self.since_ns: int | None = None          # every rank under the floor since
        self.named = False
        self.last: dict | None = None             # the last look's numbers

    def feed(self, recs: np.ndarray, rank_of: dict[int, int | None]) -> list[Diagnosis]:
        if len(recs) == 0:
            return []
        fn = recs["fn"].astype(np.int64)
        cs, ss = self._count[fn], self._size[fn]
        m = (cs >= 0) & (recs["dur_ns"] > 0)
        if not m.any():
            return []
        sel, cs, ss = recs[m], cs[m], ss[m]
        rows = np.arange(len(sel))
        size = sel["args"][rows, ss].astype(np.float64)
        nbytes = sel["args"][rows, cs].astype(np.float64) * size
        # An element size other than 1-8 bytes is a layout gloo no longer has
        # (probes/gloo.toml): the count means nothing then.
        ok = (nbytes >= MIN_BYTES) & (size >= 1) & (size <= 8)
        if not ok.any():
            return []
        sel, nbytes = sel[ok], nbytes[ok]
        end = sel["start_ns"].astype(np.int64) + sel["dur_ns"].astype(np.int64)
        gbps = nbytes * 8 / sel["dur_ns"].astype(np.float64)
        for pid, e, g in zip(sel["pid"].tolist(), end.tolist(), gbps.tolist()):
            rank = rank_of.get(pid)
            if rank is not None:
                self.samples.setdefault(rank, deque(maxlen=4 * self.min_calls + 256)).append(
                    (e, g))
        return self._look(int(end.max()))

    def _look(self, now_ns: int) -> list[Diagnosis]:
        lo = now_ns - self.window_ns
        near = self.activity.near(now_ns, QUIET_NS + self.window_ns)
        if len(self.samples) < 2 or any(s.end_ns is None for s in near):
            self.since_ns = None            # our own load now: no look
            return []
        # Only calls clear of our own load (and QUIET_NS after it) count.
        lo = max([lo] + [s.end_ns + QUIET_NS for s in near])
        fast = {}
        for rank, q in self.samples.items():
            g = [x for t, x in q if t >= lo]
            if len(g) < self.min_calls:
                self.since_ns = None
                return []
            fast[rank] = float(np.quantile(g, self.quantile))
        self.last = {"gbps": {str(r): round(x, 3) for r, x in sorted(fast.items())}}
        if max(fast.values()) >= self.floor_gbps:
            self.since_ns = None
            if min(fast.values()) >= CLEAR * self.floor_gbps:
                self.named = False
            return []
        if self.since_ns is None:
            self.since_ns = now_ns
        if self.named or now_ns - self.since_ns < self.hold_ns:
            return []
        self.named = True
        ranks = sorted(fast)
        comm = self.topology.communicator_of(ranks) if self.topology is not None else None
        where = f" of {comm['name']}" if comm else ""
        top = max(fast.values())
        return [Diagnosis(
            "passive", "communication",
            f"collectives{where} move at most {top:.2f} Gbit/s on every rank (the fastest "
            f"{100 * (1 - self.quantile):.0f}% of their calls of {MIN_BYTES // 1024} KiB or "
            f"more), under {self.floor_gbps:g} Gbit/s: a link this slow is faulty, whatever "
            "the job did before; validation measures which",
            None, ranks, comm["name"] if comm else None, None,
            details={"method": "bandwidth", "floor_gbps": self.floor_gbps,
                     "quantile": self.quantile, "since_ns": self.since_ns, **self.last})]
