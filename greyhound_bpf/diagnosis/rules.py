"""Validation's decision rules, pure: which device or link the measurements
name, and which edges to measure in which rounds. No I/O: the validator
(greyhound_bpf.diagnosis.validator) measures, these rules judge, and the
same measurements always give the same verdict (replayed by JobAnalysis).

Decision (`decide`): the reference is the *lower* median of the measured
values, so that with two devices the faster one is the reference and one
slow device among four cannot drag the reference up; its spread is the
median absolute deviation, floored at 5% of the reference (identical
devices differ by a few percent, and a MAD of 0 would flag noise).

- a device is slow when its GEMM takes >= SLOW_RATIO (1.5x) the reference
  *and* is >= ROBUST_Z (4) spreads above it. FALCON uses 2x for "comp",
  which misses GPUs throttled to 60% of their clock, a common thermal
  failure; 1.5x is far above the few percent that healthy identical devices
  differ by (the healthy runs in tests/test_validate measure that);
- a rank's *link* is slow when even its fastest edge's round trip is
  >= LINK_SLOW_RATIO (2x) the reference and ROBUST_Z spreads above it: a
  rank's own NIC or veth bounds every edge it is on, and any other rank has
  at least one fast edge left. That needs one of its edges to reach a rank
  whose link is fast: two ranks whose only edge is each other (a node's two
  ranks, judged inside the node) show one slow edge, not two slow links,
  and go to the edge rule. Links get 2x, not 1.5x, because the speed a
  host measures on a link also depends on the CPU that moves the bytes
  (TCP stack, copies): CPU contention alone makes edges of a healthy
  2-core host differ by up to ~1.5x (seen in tests/test_validate's
  pre-check), while the link failures of the field (a lane down, a
  renegotiated speed, a rate limit, a congested path) cost 2x or more.
  FALCON's 1.1x for "comm" flags noise on any shared host;
- with many machines (a rank -> node map in the result), a *node's link* is
  slow when even its fastest edge to another node is, by the same rule a
  level up; it needs three nodes or more (with two, either end could be
  the slow one) and explains its ranks' slow edges. With the map, edges
  inside a node and edges between nodes are judged apart (loopback or
  NVLink against a NIC: every edge between nodes would read slow next to
  the ones inside);
- otherwise an *edge* is slow when it alone is >= EDGE_SLOW_RATIO (3x): a
  slow path between two hosts, not either host's link. One edge is weaker
  evidence than every edge of a rank: on a busy 2-core host an edge
  measured twice read 2.0x in a healthy run;
- no rule fires: ``unknown`` (healthy), with every number in `details`.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .verdict import Diagnosis

SLOW_RATIO = 1.5             # devices
LINK_SLOW_RATIO = 2.0        # a rank's link (every edge of the rank)
EDGE_SLOW_RATIO = 3.0        # one edge alone
ROBUST_Z = 4.0
MAD_FLOOR = 0.05


def ring_edges(ranks: list[int]) -> list[tuple[int, int]]:
    """Ring neighbours in the order given: a communicator's ranks in their
    communicator-rank order (the order NCCL and gloo rings use by default)."""
    r = list(ranks)
    if len(r) < 2:
        return []
    if len(r) == 2:
        return [(r[0], r[1])]
    return [(r[i], r[(i + 1) % len(r)]) for i in range(len(r))]


def schedule(edges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs, each edge once (greedy edge colouring, in
    order): a ring of even length takes 2 rounds, an odd one 3."""
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set[int]] = []
    seen = set()
    for a, b in edges:
        e = (min(a, b), max(a, b))
        if a == b or e in seen:
            continue
        seen.add(e)
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[i].append(e)
                used |= {a, b}
                break
        else:
            rounds.append([e])
            busy.append({a, b})
    return rounds


@dataclass
class Result:
    devices: dict[int, dict] = field(default_factory=dict)     # rank -> gemm reply
    links: dict[tuple[int, int], dict] = field(default_factory=dict)
    rounds: list[list[tuple[int, int]]] = field(default_factory=list)
    untested: list[str] = field(default_factory=list)
    paused_s: float = 0.0               # the longest pause
    pauses: int = 0                     # 2 when suspects were confirmed after a run
    seconds: float = 0.0
    measured_at_ns: int | None = None   # wall clock when measuring began
    nodes: dict[int, str] = field(default_factory=dict)   # rank -> node (many machines)
    between_nodes: bool = False         # one node's part of the links between nodes

    def to_dict(self) -> dict:
        """JSON-able (links keyed "A<->B"), for recordings."""
        d = {"devices": {str(r): d for r, d in sorted(self.devices.items())},
             "links": {link_name(e): d for e, d in sorted(self.links.items())},
             "rounds": [[list(e) for e in rnd] for rnd in self.rounds],
             "untested": list(self.untested), "paused_s": self.paused_s,
             "pauses": self.pauses, "seconds": self.seconds,
             "measured_at_ns": self.measured_at_ns}
        if self.nodes:
            d["nodes"] = {str(r): n for r, n in sorted(self.nodes.items())}
        if self.between_nodes:
            d["between_nodes"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        def edge(name):
            a, b = name.split("<->")
            return int(a), int(b)
        return cls({int(r): dict(v) for r, v in d.get("devices", {}).items()},
                   {edge(k): dict(v) for k, v in d.get("links", {}).items()},
                   [[tuple(e) for e in rnd] for rnd in d.get("rounds", [])],
                   list(d.get("untested", [])), float(d.get("paused_s", 0.0)),
                   int(d.get("pauses", 0)), float(d.get("seconds", 0.0)),
                   d.get("measured_at_ns"), {int(r): n for r, n in d.get("nodes", {}).items()},
                   bool(d.get("between_nodes", False)))


def outliers(values: dict, ratio: float = SLOW_RATIO, z: float = ROBUST_Z):
    """{key: value} (larger is slower) -> (reference, spread, {key: ratio} of the slow)."""
    if not values:
        return None, None, {}
    vals = sorted(values.values())
    ref = statistics.median_low(vals)
    spread = max(statistics.median_low([abs(v - ref) for v in vals]), MAD_FLOOR * ref)
    slow = {k: v / ref for k, v in values.items()
            if ref > 0 and v >= ratio * ref and (v - ref) >= z * spread}
    return ref, spread, slow


def keep_better(first: dict | None, again: dict | None, key: str) -> dict | None:
    """One device's or edge's measurement and its second look: the better
    (lower `key`) is kept, and `passes` counts the times it was measured. A
    busy moment of a shared host rarely hits the same device twice; a slow
    device is slow each time. A failed second look (None) is not a pass."""
    if again is None or first is None:
        return first if again is None else {**again, "passes": again.get("passes", 1)}
    keep = first if first[key] <= again[key] else again
    return {**keep, "passes": first.get("passes", 1) + 1}


def _device_slow(details: dict, rank: int) -> bool | None:
    """Did a validation (its `details`) measure `rank`'s device slow, judged
    as `decide` judges it? None where it was not measured, or was measured
    alone (no reference to judge it by)."""
    gemm = {int(r): d["ms_per_gemm"] for r, d in (details.get("devices") or {}).items()}
    if rank not in gemm or len(gemm) < 2:
        return None
    return rank in outliers(gemm)[2]


def device_healthy(details: dict, rank: int) -> bool:
    return _device_slow(details, rank) is False


def device_slow(details: dict, rank: int) -> bool:
    return _device_slow(details, rank) is True


def _rank_links(rtt: dict):
    """A rank's link bounds each of its edges: its fastest edge is its link.
    -> (reference, {rank: ratio} of the slow rank links)."""
    return _slow_ends(rtt.items())


def _node_links(rtt: dict, nodes: dict[int, str]):
    """The same rule a level up, with many machines: a node's link (its NIC,
    its switch port) bounds every edge between it and another node, so the
    fastest of those is its link. -> (reference, {node: ratio} of the slow);
    with two nodes, none (either end could be the slow one)."""
    return _slow_ends(((nodes[a], nodes[b]), v) for (a, b), v in rtt.items()
                      if nodes.get(a) is not None and nodes.get(b) is not None
                      and nodes[a] != nodes[b])


def _slow_ends(edges) -> tuple:
    """((end, end), round trip) pairs -> (reference, {end: ratio}): the ends
    whose fastest edge is slow, among three ends or more. An end counts only
    with an edge to an end that is not slow: ends whose every edge joins
    another slow end (the two ranks of a node whose only edge inside it is
    each other) rest on one slow edge, not on a link each, and the edge rule
    judges that."""
    best: dict = {}
    peers: dict = {}
    for (a, b), v in edges:
        for end, other in ((a, b), (b, a)):
            best[end] = min(best.get(end, v), v)
            peers.setdefault(end, set()).add(other)
    if len(best) < 3:
        return None, {}
    ref, _, slow = outliers(best, LINK_SLOW_RATIO)
    return ref, {k: v for k, v in slow.items() if peers[k] - slow.keys()}


def link_suspects(rtt: dict) -> set:
    """Edges a link verdict would rest on: every edge of a slow rank link,
    and every slow edge."""
    _, ranks = _rank_links(rtt)
    out = {e for e in rtt if set(e) & set(ranks)}
    if len(rtt) >= 3:
        out |= set(outliers(rtt, EDGE_SLOW_RATIO)[2])
    return out


def _link_cause(rtt: dict, details: dict, key: str):
    """A rank's link (every edge of the rank slow), else one slow edge,
    among these edges: a cause tuple, or None."""
    lref, slow_rank_link = _rank_links(rtt)
    if lref is not None:
        details[key] = round(lref, 4)
    if slow_rank_link:
        ranks = sorted(slow_rank_link)
        name = ", ".join(f"rank {r}" for r in ranks)
        return ("communication", ranks, name, f"every edge of {name} is slow (fastest x"
                + ", x".join(f"{slow_rank_link[r]:.2f}" for r in ranks)
                + f" the reference {lref:.2f} ms round trip): its own link")
    if len(rtt) >= 3:
        _, _, slow_edges = outliers(rtt, EDGE_SLOW_RATIO)
        if slow_edges:
            edges = sorted(slow_edges)
            return ("communication", sorted({r for e in edges for r in e}),
                    ", ".join(map(link_name, edges)),
                    "edge " + ", ".join(f"{link_name(e)} x{slow_edges[e]:.2f}" for e in edges)
                    + " the reference round trip; both ends' other edges are fast")
    return None


def link_name(edge: tuple[int, int]) -> str:
    return f"{edge[0]}<->{edge[1]}"


def decide(res: Result, index: int | None = None) -> Diagnosis:
    """The verdict of the measurements (evidence: validation)."""
    gemm = {r: d["ms_per_gemm"] for r, d in res.devices.items()}
    rtt = {e: d["rtt_ms"] for e, d in res.links.items()}
    details = {
        "devices": {str(r): {k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in d.items()} for r, d in sorted(res.devices.items())},
        "links": {link_name(e): {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in d.items()} for e, d in sorted(res.links.items())},
        "rounds": [[link_name(e) for e in rnd] for rnd in res.rounds],
        "untested": res.untested, "paused_s": round(res.paused_s, 3), "pauses": res.pauses,
        "measured_at_ns": res.measured_at_ns,
        "seconds": round(res.seconds, 3),
        "thresholds": {"slow_ratio": SLOW_RATIO, "link_slow_ratio": LINK_SLOW_RATIO,
                       "edge_slow_ratio": EDGE_SLOW_RATIO,
                       "robust_z": ROBUST_Z, "mad_floor": MAD_FLOOR},
    }
    if res.nodes:
        details["nodes"] = {str(r): n for r, n in sorted(res.nodes.items())}
    causes = []
    ref, _, slow_dev = outliers(gemm) if len(gemm) >= 2 else (None, None, {})
    if ref is not None:
        details["gemm_reference_ms"] = round(ref, 4)
    if slow_dev:
        ranks = sorted(slow_dev)
        causes.append(("computation", ranks, None,
                       "GEMM " + ", ".join(f"rank {r} x{slow_dev[r]:.2f}" for r in ranks)
                       + f" the reference ({ref:.2f} ms)"))
    classes = [("link_reference_ms", rtt)]
    if res.nodes:
        # Links inside a node (NVLink, loopback) and between nodes (a NIC, a
        # switch) are different kinds: each is judged against its own.
        inside = {e: v for e, v in rtt.items() if res.nodes.get(e[0]) == res.nodes.get(e[1])}
        between = {e: v for e, v in rtt.items() if e not in inside}
        classes = [("link_reference_ms", inside)]
        nref, slow_node = _node_links(between, res.nodes)
        if nref is not None:
            details["node_link_reference_ms"] = round(nref, 4)
        if slow_node:
            names = sorted(slow_node)
            ranks = sorted({r for e in between for r in e if res.nodes.get(r) in slow_node})
            what = ", ".join(f"node {n}" for n in names)
            causes.append(("communication", ranks, what,
                           f"every edge between {what} and the other nodes is slow (fastest x"
                           + ", x".join(f"{slow_node[n]:.2f}" for n in names)
                           + f" the reference {nref:.2f} ms round trip): the node's own link"))
        else:                            # (a slow node link explains its edges)
            classes.append(("between_nodes_link_reference_ms", between))
    for key, part in classes:
        cause = _link_cause(part, details, key)
        if cause:
            causes.append(cause)
    if len(causes) == 1:
        cause, ranks, link, reason = causes[0]
        return Diagnosis("validation", cause, reason, index, tuple(ranks), link=link,
                         details=details)
    if len(causes) > 1:
        return Diagnosis("validation", "unknown", "both a device and a link measure slow: "
                         + "; ".join(c[3] for c in causes), index,
                         tuple(sorted({r for c in causes for r in c[1]})),
                         link=next((c[2] for c in causes if c[2]), None), details=details)
    what = []
    if gemm:
        what.append(f"{len(gemm)} device(s)")
    if rtt:
        what.append(f"{len(rtt)} link(s)")
    reason = ("no slow device or link among " + " and ".join(what) if what
              else "nothing could be measured")
    if res.untested:
        reason += f"; not tested: {'; '.join(res.untested)}"
    return Diagnosis("validation", "unknown", reason, index, details=details)


def edges_of(topology: dict | None, ranks: list[int]) -> list[tuple[int, int]]:
    """Ring edges of every communicator of a `topology` event's map, and its
    pipeline edges, among `ranks`; the ring of all ranks without a map."""
    have = set(ranks)
    edges: list[tuple[int, int]] = []
    for c in (topology or {}).get("communicators", []):
        edges += ring_edges([r for r in c["ranks"] if r in have])
    edges += [(a, b) for a, b in (topology or {}).get("p2p_edges", []) if a in have and b in have]
    return edges or ring_edges(sorted(ranks))
