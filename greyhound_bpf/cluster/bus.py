"""The agents' and the controller's Redis Streams (issue #14).

Each node's agent appends to its own stream, `gh:{job}:ev:{node}`, which
its Redis user alone may write (ACL key pattern): `hello` (its ranks, their
pids and the agent's incarnation), `iterations` (a few per second: each
rank's iterations since the last batch), `heartbeat`. Every message has the
agent's `seq`, counted per incarnation, so a message delivered twice (a
controller that restarted before acknowledging it) is dropped by
(node, incarnation, seq). Streams are trimmed with `MAXLEN ~`.

The controller reads every node's stream through one consumer group, and
`JobInputs` turns the messages into JobAnalysis inputs: a rank's pid on its
node becomes one analysis key for the whole job.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..analysis import Iterations, Targets
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

    def iterations(self, t_ns: int, pid: int, items: list[dict]) -> str:
        return self.publish("iterations", t_ns, pid=pid, items=items)

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
        import redis
        self.r, self.consumer = client, consumer
        self.streams = {events_stream(job, n): n for n in nodes}
        for s in self.streams:
            try:
                self.r.xgroup_create(s, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def read(self, block_ms: int = 1000, count: int = 1000) -> list[Message]:
        resp = self.r.xreadgroup(GROUP, self.consumer, {s: ">" for s in self.streams},
                                 count=count, block=block_ms) or []
        out = []
        for stream, entries in resp:
            stream = _text(stream)
            for mid, raw in entries:
                f = {_text(k): _text(v) for k, v in raw.items()}
                out.append(Message(self.streams[stream], stream, _text(mid), f["kind"],
                                   int(f["t"]), int(f["seq"]), f["inc"], json.loads(f["data"])))
        return out

    def ack(self, msgs: list[Message]) -> None:
        by: dict[str, list[str]] = {}
        for m in msgs:
            by.setdefault(m.stream, []).append(m.id)
        for s, ids in by.items():
            self.r.xack(s, GROUP, *ids)


def _text(v) -> str:
    """A reply's bytes as text (whatever the client's decode_responses)."""
    return v.decode() if isinstance(v, bytes) else v


class JobInputs:
    """Messages -> JobAnalysis inputs. A rank is keyed by (node, pid), one
    integer per rank for the whole job; a message already taken (same
    node, incarnation and seq or older) gives nothing."""

    def __init__(self):
        self.keys: dict[tuple[str, int], int] = {}
        self.node_of: dict[int, str] = {}
        self._last: dict[tuple[str, str], int] = {}

    def key(self, node: str, pid: int) -> int:
        k = self.keys.setdefault((node, int(pid)), len(self.keys) + 1)
        self.node_of[k] = node
        return k

    def inputs(self, m: Message) -> list:
        last = self._last.get((m.node, m.incarnation), 0)
        if m.seq <= last:
            return []
        self._last[(m.node, m.incarnation)] = m.seq
        if m.kind == "hello":
            added = tuple({**r, "pid": self.key(m.node, r["pid"]), "node": m.node}
                          for r in m.data.get("ranks", ()))
            return [Targets(m.t_ns, added, (), m.data.get("begin_ns"))]
        if m.kind == "iterations":
            return [Iterations(m.t_ns, self.key(m.node, m.data["pid"]),
                               tuple(m.data.get("items", ())))]
        return []
