"""The agents' and the controller's Redis Streams (issue #14).

Each node's agent appends to its own stream, `gh:{job}:ev:{node}`, which
its Redis user alone may write (ACL key pattern): `hello` (its ranks, their
pids and the agent's incarnation), `iterations` (a few per second: the
node's ranks' iterations since the last batch, one message), `heartbeat`. Every message has the
agent's `seq`, counted per incarnation, so a message delivered twice (a
controller that restarted before acknowledging it) is dropped by
(node, incarnation, seq). Streams are trimmed with `MAXLEN ~`.

The controller reads every node's stream through one consumer group, and
`JobInputs` turns the messages into JobAnalysis inputs: a rank's pid on its
node becomes one analysis key for the whole job.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..analysis import Acks, Collectives, Communicators, Iterations, Targets
from .identity import check_name, events_stream

MAXLEN = 100_000          # per node: minutes of iteration batches at a few per second
GROUP = "greyhound-controller"


class AgentBus:
    """A node's publisher. `client`: a redis.Redis logged in as the node's
    own user."""

    def __init__(self, client, job: str, node: str, incarnation: str):
        self.r, self.node = client, check_name("node", node)
        self.stream = events_stream(job, node)
        self.incarnation, self.seq = incarnation, 0

    def publish(self, kind: str, t_ns: int, **data) -> str:
        self.seq += 1
        return self.r.xadd(self.stream, {"kind": kind, "t": int(t_ns), "seq": self.seq,
                                         "inc": self.incarnation, "data": json.dumps(data)},
                           maxlen=MAXLEN, approximate=True)

    def hello(self, t_ns: int, ranks: list[dict], begin_ns: int | None = None) -> str:
        """`ranks`: pid, rank, local_rank, world_size, comm of each local rank."""
        return self.publish("hello", t_ns, ranks=ranks, begin_ns=begin_ns)

    def iterations(self, t_ns: int, by_pid: dict[int, list[dict]]) -> str:
        """The node's ranks' iterations since the last batch: one message."""
        return self.publish("iterations", t_ns, ranks={str(p): v for p, v in by_pid.items()})

    def heartbeat(self, t_ns: int) -> str:
        return self.publish("heartbeat", t_ns)


@dataclass(frozen=True)
class Message:
    node: str
    stream: str
    id: str
    kind: str
    t_ns: int
    seq: int
    incarnation: str
    data: dict


class ControllerBus:
    """Reads the nodes' streams through one consumer group (created at the
    start of each stream if absent: a restarted controller resumes where
    the group stopped, with what it had not acknowledged pending)."""

    def __init__(self, client, job: str, nodes: list[str], consumer: str = "controller-1"):
        self.r, self.job, self.consumer = client, job, consumer
        self.streams: dict[str, str] = {}
        self.lost_groups = False
        for n in nodes:
            self.add(n)

    def add(self, node: str) -> bool:
        """Read `node`'s stream from now on (True when it is new)."""
        import redis
        s = events_stream(self.job, node)
        if s in self.streams:
            return False
        try:
            self.r.xgroup_create(s, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.streams[s] = node
        return True

    def discover(self) -> list[str]:
        """Nodes whose agents have written a stream of this job, not read yet."""
        prefix = events_stream(self.job, "x")[:-1]
        found = [_text(k)[len(prefix):] for k in
                 self.r.scan_iter(match=prefix + "*", count=1000, _type="stream")]
        return [n for n in sorted(found) if self.add(n)]

    def history(self) -> list["Message"]:
        """What the group has delivered already, oldest first per stream (a
        new leader rebuilds the analysis from it), with the messages that
        were delivered but never acknowledged claimed for this consumer and
        acknowledged: the rebuild has taken them."""
        out = []
        for s, node in self.streams.items():
            groups = {_text(g["name"]): g for g in self.r.xinfo_groups(s)}
            last = _text(groups[GROUP]["last-delivered-id"]) if GROUP in groups else "0-0"
            if last == "0-0":
                continue
            start = "-"
            while True:
                batch = self.r.xrange(s, start, last, count=10_000)
                out += [self._message(s, mid, raw) for mid, raw in batch]
                if len(batch) < 10_000:
                    break
                start = "(" + _text(batch[-1][0])
            nxt = "0-0"
            while True:
                nxt, claimed, *_ = self.r.xautoclaim(s, GROUP, self.consumer, 0, nxt,
                                                     count=1000)
                if claimed:
                    self.r.xack(s, GROUP, *[mid for mid, _ in claimed])
                if _text(nxt) == "0-0":
                    break
        return out

    def read(self, block_ms: int = 1000, count: int = 1000) -> list["Message"]:
        if not self.streams:
            time.sleep(block_ms / 1000)      # no node yet: nothing to wait on in Redis
            return []
        import redis
        try:
            resp = self.r.xreadgroup(GROUP, self.consumer, {s: ">" for s in self.streams},
                                     count=count, block=block_ms) or []
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # Redis restarted without its data: the groups (and streams) are
            # gone. Make them again; the caller says what was lost.
            streams, self.streams = self.streams, {}
            for node in streams.values():
                self.add(node)
            self.lost_groups = True
            return []
        return [self._message(_text(stream), mid, raw)
                for stream, entries in resp for mid, raw in entries]

    def _message(self, stream: str, mid, raw: dict) -> "Message":
        f = {_text(k): _text(v) for k, v in raw.items()}
        return Message(self.streams[stream], stream, _text(mid), f["kind"], int(f["t"]),
                       int(f["seq"]), f["inc"], json.loads(f["data"]))

    def ack(self, msgs: list[Message]) -> None:
        by: dict[str, list[str]] = {}
        for m in msgs:
            by.setdefault(m.stream, []).append(m.id)
        pipe = self.r.pipeline(transaction=False)      # one round trip for every stream
        for s, ids in by.items():
            pipe.xack(s, GROUP, *ids)
        pipe.execute()


def _text(v) -> str:
    """A reply's bytes as text (whatever the client's decode_responses)."""
    return v.decode() if isinstance(v, bytes) else v


class JobInputs:
    """Messages -> JobAnalysis inputs. A rank is keyed by (node, pid), one
    integer per rank for the whole job; a message already taken (same
    node, incarnation and seq or older) gives nothing. A `hello` lists all
    of a node's ranks: those it adds are announced, those it no longer
    lists have exited. A new incarnation (the agent restarted) announces
    them all again."""

    def __init__(self):
        self.keys: dict[tuple[str, int], int] = {}
        self.node_of: dict[int, str] = {}
        self.present: dict[str, dict[int, dict]] = {}   # node -> key -> its hello entry
        self.incarnation: dict[str, str] = {}
        self.acks: dict[str, dict] = {}                  # node -> rank -> ack doc
        self.lost: dict[str, dict[int, dict]] = {}      # node -> its ranks, while it is lost
        self._last: dict[tuple[str, str], int] = {}

    def key(self, node: str, pid: int) -> int:
        k = self.keys.get((node, pid))
        if k is None:
            k = self.keys[(node, pid)] = len(self.keys) + 1
            self.node_of[k] = node
        return k

    def fresh(self, m: Message) -> bool:
        """Not taken before (and from now on it is)."""
        last = self._last.get((m.node, m.incarnation), 0)
        if m.seq <= last:
            return False
        self._last[(m.node, m.incarnation)] = m.seq
        return True

    def new(self, msgs: list[Message]) -> list[Message]:
        """Those of `msgs` not taken before (and from now on they are). Told
        in the order each agent sent them: an agent sends the events it saw
        after a batch of iterations, with earlier times, and in time order
        the batch would look taken already."""
        return [m for m in sorted(msgs, key=lambda m: (m.node, m.incarnation, m.seq))
                if self.fresh(m)]

    def inputs(self, m: Message) -> list:
        return self.convert(m) if self.fresh(m) else []

    def convert(self, m: Message) -> list:
        """The analysis inputs in a message (taken: see `fresh`)."""
        if m.kind == "hello":
            return self._hello(m)
        if m.kind == "iterations":
            return [Iterations(m.t_ns, self.key(m.node, int(pid)), items)
                    for pid, items in sorted(m.data.get("ranks", {}).items()) if items]
        if m.kind == "collectives":
            calls = {self.key(m.node, int(pid)): tuple(map(tuple, items))
                     for pid, items in sorted(m.data.get("ranks", {}).items()) if items}
            return [Collectives(m.t_ns, calls)] if calls else []
        if m.kind == "event" and (m.data.get("event") or {}).get("kind") == "topology":
            ev = m.data["event"]
            return [Communicators(m.t_ns, m.node, {"communicators": ev.get("communicators", []),
                                                   "p2p_edges": ev.get("p2p_edges", [])})]
        if m.kind == "acks":
            self.acks[m.node] = dict(m.data.get("docs") or {})
            return [Acks(m.t_ns, {r: d for docs in self.acks.values() for r, d in docs.items()},
                         m.data.get("restart_observed_s"))]
        return []

    def _hello(self, m: Message) -> list:
        now = {self.key(m.node, int(r["pid"])): {**r, "pid": self.key(m.node, int(r["pid"])),
                                                   "node": m.node}
               for r in m.data.get("ranks", ())}
        before = self.present.get(m.node, {})
        again = self.incarnation.get(m.node) != m.incarnation
        self.incarnation[m.node] = m.incarnation
        self.present[m.node] = now
        added = tuple(d for k, d in now.items() if again or k not in before)
        exited = tuple(k for k in before if k not in now)
        if not added and not exited:
            return []
        return [Targets(m.t_ns, added, exited, m.data.get("begin_ns"))]

    def lose(self, node: str, t_ns: int) -> list:
        """The node's agent is lost: its ranks are gone until it says hello
        again (and its acks no longer count)."""
        self.lost[node] = self.present.pop(node, {})
        self.acks.pop(node, None)
        return [Targets(t_ns, exited=tuple(self.lost[node]))] if self.lost[node] else []

    def revive(self, node: str, t_ns: int) -> list:
        """The same agent speaks again: its ranks are back (a new agent
        announces them itself)."""
        back = self.present[node] = self.lost.pop(node, {})
        return [Targets(t_ns, tuple(back.values()))] if back else []

    def hellos(self) -> dict[str, list[dict]]:
        """node -> its ranks, for the census."""
        return {n: list(d.values()) for n, d in self.present.items()}
