"""The communicator map, from what the probes see; nothing from the framework.

- **NCCL**: `ncclCommInitRank[Config]` gives, per process, a communicator
  (the pointer read at return), its size and the process's rank in it;
  `ncclCommSplit` derives one from a parent by colour and key;
  `ncclSend`/`ncclRecv` name a peer within a communicator: pipeline edges.
  Processes' communicators are matched by *identity*, not pointer (every
  process has its own): the k-th init of size N in each process belongs to
  the same communicator, split into groups of N when more than N processes
  make one (e.g. tensor-parallel pairs: members are taken in job-rank order,
  each group taking one process per communicator rank); a split's identity
  is its parent's plus its colour and its order. A failed init (non-zero
  return) is listed with its state: an operator wants to see it.
- **gloo**: its collectives carry no communicator handle the probes read, so
  groups come from the call pattern: processes that issue the same set of
  collective types (function and element count) are one group. Two gloo
  groups in one process with identical traffic are indistinguishable.

`Topology.feed` takes tracer batches; `changed()` says when a new `topology`
event is due, and `fields()` is its content.

With many machines each node's agent sees only its own ranks' part of a
communicator. Every communicator in the map carries its identity (`key`,
the same in every process) and each rank's place in it (`order`), so the
job's controller merges the nodes' maps (`merge`): parts with one key are
put together in order, an init's parts up to its size with no place
taken twice (the tensor-parallel pairs of different nodes share a key and
stay apart).
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..probe.catalog import FIELD_SLOT0, Catalog

GLOO_PATTERN_CALLS = 32      # collectives per process before its pattern counts


@dataclass
class _Comm:
    key: tuple                     # identity across processes
    nranks: int | None
    members: dict[int, int | None] = field(default_factory=dict)   # job rank -> rank in comm
    failed: dict[int, int] = field(default_factory=dict)           # job rank -> return code
    sort: dict[int, tuple] = field(default_factory=dict)           # job rank -> order key


class Topology:
    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        fns = catalog.functions
        self._rare = np.array([fn.family == "nccl" and fn.kind in ("init", "p2p")
                               for fn in fns], dtype=bool)
        self._gloo = np.array([fn.family == "gloo" and fn.kind == "collective"
                               for fn in fns], dtype=bool)
        self._count_slot = np.full(len(fns), -1, dtype=np.int64)
        for fn in fns:
            names = [f for f, _ in fn.fields]
            if "count" in names:
                self._count_slot[fn.fid] = FIELD_SLOT0 + names.index("count")
        # per process: comm pointer -> identity key; init/split ordinals
        self.ptr: dict[int, dict[int, tuple]] = defaultdict(dict)
        self.ordinal: dict[int, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
        self.comms: dict[tuple, _Comm] = {}
        self.p2p: set[tuple[tuple, int, int]] = set()       # (comm key, job rank, peer comm rank)
        self.gloo_types: dict[int, set] = defaultdict(set)   # job rank -> {(fn, count)}
        self.gloo_calls: dict[int, int] = defaultdict(int)
        self._last: dict | None = None
        self.nodes: dict[str, dict] = {}                     # node -> its map (a controller's)
        self._merged: tuple | None = None                    # (our own map, the merge)

    # -- input ----------------------------------------------------------------------

    def feed(self, recs: np.ndarray, rank_of: dict[int, int | None]) -> None:
        if len(recs) == 0:
            return
        fn = recs["fn"].astype(np.int64)
        for r in recs[self._rare[fn]]:
            rank = rank_of.get(int(r["pid"]))
            if rank is not None:
                self._nccl(rank, int(r["pid"]), r)
        g = self._gloo[fn]
        if g.any():
            sel = recs[g]
            f = sel["fn"].astype(np.int64)
            slot = self._count_slot[f]
            rows = np.arange(len(sel))
            count = np.where(slot >= 0, sel["args"][rows, np.maximum(slot, 0)], 0)
            for pid in np.unique(sel["pid"]).tolist():
                rank = rank_of.get(pid)
                if rank is None:
                    continue
                m = sel["pid"] == pid
                self.gloo_calls[rank] += int(m.sum())
                if self.gloo_calls[rank] - int(m.sum()) < GLOO_PATTERN_CALLS:
                    self.gloo_types[rank] |= set(zip(f[m].tolist(), count[m].tolist()))

    def _nccl(self, rank: int, pid: int, r) -> None:
        spec = self.catalog.functions[int(r["fn"])]
        a = self.catalog.decode(spec, r["args"], int(r["ret"]), int(r["flags"]))
        if spec.kind == "p2p":
            key = self.ptr[pid].get(a.get("comm"))
            if key is not None and a.get("peer") is not None:
                self.p2p.add((key, rank, a["peer"]))
            return
        ords = self.ordinal[pid]
        if spec.name == "ncclCommSplit":
            parent = self.ptr[pid].get(a.get("parent"))
            if parent is None:
                return                    # split of a communicator made before we attached
            base = ("split", parent, a["color"])
            ords[base] += 1
            key = (*base, ords[base])
            c = self.comms.setdefault(key, _Comm(key, None))
            pc = self.comms[parent].members.get(rank)
            c.sort[rank] = (a.get("key", 0), pc if pc is not None else rank)
            c.members[rank] = None
        else:
            n = a.get("nranks")
            base = ("init", n)
            ords[base] += 1
            key = (*base, ords[base])
            c = self.comms.setdefault(key, _Comm(key, n))
            c.members[rank] = a.get("comm_rank")
            c.sort[rank] = (rank,)
        ret = a.get("ret")
        if ret:
            c.failed[rank] = ret
        if a.get("comm"):
            self.ptr[pid][a["comm"]] = key

    # -- output -----------------------------------------------------------------------

    def _groups(self, c: _Comm) -> list[list[tuple[int, int]]]:
        """[(job rank, rank in comm)] per group: one communicator identity
        made by several disjoint groups is cut into groups of nranks."""
        order = sorted(c.members, key=lambda r: (c.sort[r], r))
        if c.key[0] == "split":
            return [[(r, i) for i, r in enumerate(order)]]
        n = c.nranks or len(order)
        groups: list[dict[int, int]] = []
        for r in order:
            cr = c.members[r]
            home = next((g for g in groups if cr not in g.values() and len(g) < n), None)
            if home is None:
                home = {}
                groups.append(home)
            home[r] = cr
        return [sorted(g.items(), key=lambda kv: kv[1]) for g in groups]

    def fields(self) -> dict:
        comms, names, edges = [], {}, set()
        for c in sorted(self.comms.values(), key=lambda c: _order(c.key)):
            for grp in self._groups(c):
                name = f"nccl:{len(comms)}"
                ranks = [r for r, _ in grp]
                parent = names.get((c.key[1], ranks[0])) if c.key[0] == "split" else None
                failed = {str(r): c.failed[r] for r in ranks if r in c.failed}
                comms.append({"name": name, "backend": "nccl", "ranks": ranks,
                              "key": str(c.key), "order": [list(c.sort[r]) if c.key[0] == "split"
                                                          else [cr] for r, cr in grp],
                              "nranks": c.nranks or len(ranks),
                              "source": "split" if c.key[0] == "split" else "init",
                              "parent": parent,
                              **({"parent_key": str(c.key[1])} if c.key[0] == "split" else {}),
                              # (job rank, peer's rank in the communicator): the merge
                              # finds a peer on another node
                              "p2p": sorted([r, peer] for key, r, peer in self.p2p
                                            if key == c.key and r in ranks),
                              "state": "failed" if failed else "ok",
                              **({"failed": failed} if failed else {})})
                for r in ranks:
                    names[(c.key, r)] = name
                by_comm_rank = dict((cr, r) for r, cr in grp)
                for key, r, peer in self.p2p:
                    if key == c.key and r in ranks and peer in by_comm_rank:
                        a, b = r, by_comm_rank[peer]
                        if a != b:
                            edges.add((min(a, b), max(a, b)))
        patterns: dict[frozenset, list[int]] = defaultdict(list)
        for rank, types in self.gloo_types.items():
            if self.gloo_calls[rank] >= GLOO_PATTERN_CALLS:
                patterns[frozenset(types)].append(rank)
        for i, (ranks, types) in enumerate(sorted((sorted(v), k) for k, v in patterns.items())):
            key = hashlib.sha1(repr(sorted(types)).encode()).hexdigest()[:12]
            comms.append({"name": f"gloo:{i}", "backend": "gloo", "ranks": ranks,
                          "key": f"gloo:{key}", "order": [[r] for r in ranks],
                          "nranks": len(ranks), "source": "call pattern", "parent": None,
                          "state": "ok"})
        out = {"communicators": comms, "p2p_edges": [list(e) for e in sorted(edges)]}
        if not self.nodes:
            return out
        # (merged again only when a map changed: the passive diagnoser asks
        # several times an iteration, and a thousand nodes' maps take a while)
        if self._merged is None or self._merged[0] != out:
            self._merged = (out, merge_maps([out, *self.nodes.values()]))
        return self._merged[1]

    def merge(self, node: str, fields: dict) -> None:
        """A node's map (its `topology` event): part of the job's."""
        if self.nodes.get(node) != fields:
            self.nodes[node] = fields
            self._merged = None

    def changed(self) -> dict | None:
        """The new map when it differs from the last one returned, else None."""
        f = self.fields()
        if not f["communicators"] or f == self._last:
            return None
        self._last = f
        return f

    def communicator_of(self, ranks: list[int]) -> dict | None:
        """The smallest communicator holding every one of `ranks`."""
        f = self._last or self.fields()
        fits = [c for c in f["communicators"] if set(ranks) <= set(c["ranks"])]
        return min(fits, key=lambda c: len(c["ranks"])) if fits else None


def _order(key: tuple) -> tuple:
    """Inits before splits, then by size and order: stable names."""
    return (0 if key[0] == "init" else 1, str(key))


def merge_maps(maps: list[dict]) -> dict:
    """Nodes' maps as the job's: each communicator's parts (one per node)
    put together by key, in order; an init of size N takes parts while
    they fit in N and take no place twice."""
    parts: dict[tuple, list[dict]] = defaultdict(list)
    for m in maps:
        for c in m.get("communicators", []):
            if "key" in c:                 # (a map from before keys: not mergeable)
                parts[(c["backend"], c["key"])].append(c)
    merged = []
    edges = {tuple(e) for m in maps for e in m.get("p2p_edges", [])}
    for (backend, key), cs in sorted(parts.items()):
        groups: list[dict] = []
        open_: list[dict] = []           # groups with room left (an init's: under its size)
        for c in sorted(cs, key=lambda c: c["order"]):
            size = c.get("nranks") or 0
            places = {tuple(o) for o in c["order"]}
            fits = next((g for g in open_ if c["source"] != "init" or (
                len(g["ranks"]) + len(c["ranks"]) <= size and not g["places"] & places)), None)
            if fits is None:
                fits = {**c, "ranks": [], "order": [], "failed": {}, "p2p": [], "places": set()}
                groups.append(fits)
                open_.append(fits)
            fits["ranks"] += c["ranks"]
            fits["order"] += c["order"]
            fits["places"] |= places
            fits["failed"].update(c.get("failed", {}))
            fits["p2p"] += c.get("p2p", [])
            if c["source"] == "init" and len(fits["ranks"]) >= size:
                open_.remove(fits)
        for g in groups:
            del g["places"]
            if g["backend"] != "nccl":
                del g["p2p"]
            placed = sorted(zip(g["order"], g["ranks"]))
            g["order"], g["ranks"] = [o for o, _ in placed], [r for _, r in placed]
            if g["source"] != "init":
                g["nranks"] = len(g["ranks"])
            at = ({o[0]: r for o, r in zip(g["order"], g["ranks"])} if g["source"] == "init"
                  else dict(enumerate(g["ranks"])))      # a split's ranks: in its order
            for r, peer in g.get("p2p", []):
                if at.get(peer, r) != r:
                    edges.add(tuple(sorted((r, at[peer]))))
            g["state"] = "failed" if g["failed"] else "ok"
            if not g["failed"]:
                del g["failed"]
            merged.append(g)
    merged.sort(key=lambda g: (g["backend"] != "nccl", g["source"] != "init", g["key"],
                               g["ranks"]))
    n: dict[str, int] = defaultdict(int)
    for g in merged:
        g["name"] = f"{g['backend']}:{n[g['backend']]}"
        n[g["backend"]] += 1
    for g in merged:
        if g.get("parent_key"):            # the parent's group that holds our first rank
            g["parent"] = next((p["name"] for p in merged if p["key"] == g["parent_key"]
                                and g["ranks"][0] in p["ranks"]), None)
    return {"communicators": merged, "p2p_edges": [list(e) for e in sorted(edges)]}
