"""A node's agent (`attach --cluster URL --node N`): the local session's
events go to the node's stream, the controller's plans come back to the
node's control file.

The attach loop hands every event to `Agent.sink`, which only queues it;
one thread does all the Redis I/O, so a slow or absent Redis never stalls
the tracer. What it publishes:

- `hello`: the node's ranks (pid, its start time, rank, local rank, world
  size, network namespace), again whenever they change and after every
  reconnection;
- `iterations`: each rank's iterations since the last batch, every BATCH_S;
- `collectives`: likewise each rank's blocking collectives, while the job
  makes too few for its iterations to be counted in time (the call-by-call
  look, diagnosis/callcross.py; KEEP_CALLS a rank held while Redis is away);
- `event`: the local slowdowns, verdicts, validations, losses and exits;
- `acks`: the node's trainers' acknowledgements, when they change;
- `heartbeat`, every HEARTBEAT_S, with what was dropped so far.

When Redis goes away the agent says so once and keeps tracing locally
(the last plan stays in the control file); iterations wait in a bounded
buffer, and what did not fit is counted, published as a `gap` when it is
back, and reported by the controller. Plans carry the controller's epoch: a
plan from an epoch older than one already seen (a deposed controller) is
not written.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time

from ..engine.iterations import ITERATION_FIELDS
from .bus import AgentBus, _text
from .connect import Endpoint, Refused, check, client
from .identity import commands_stream

HEARTBEAT_S = 1.0
BATCH_S = 0.25
ACKS_S = 0.5
RETRY_S = 2.0
MAX_BUFFERED = 50_000          # iterations held while Redis is away (minutes of a node)
KEEP_CALLS = 96                # collectives held per rank (the look's own memory)
FORWARDED = frozenset({"slowdown", "recovery", "diagnosis", "validation", "lost", "exit",
                       "topology", "unprobed_site", "activity"})


class Rendezvous:
    """Where the workers measuring the links between nodes meet
    (diagnosis.crosslinks): the first rank's node offers its store's
    address, the controller tells every node (a `links_join` command)."""

    def __init__(self, offer):
        self._offer, self._at, self._got = offer, None, threading.Event()

    def offer(self, addr: str, port: int) -> None:
        self._offer(addr, port)

    def set(self, addr: str, port: int) -> None:
        self._at = (addr, int(port))
        self._got.set()

    def wait(self, timeout: float):
        return self._at if self._got.wait(timeout) else None


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    from ..probe.discovery import read_stat
    st = read_stat(pid)
    return st.start_time if st else None


class Agent:
    def __init__(self, ep: Endpoint, job: str, node: str, control_file: str | None = None,
                 say=print, now_ns=time.time_ns, env=os.environ):
        self.ep, self.job, self.node, self.say, self.now_ns = ep, job, node, say, now_ns
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        r = client(ep, env)
        self.bus = AgentBus(r, job, node, self.incarnation)
        self.cmd_stream = commands_stream(job)
        self.online = False
        try:
            check(r, ep)
            self.online = True
        except Refused:
            raise
        except Exception as e:         # unreachable: trace locally, keep trying
            self.say(f"{e}: tracing locally, trying again every {RETRY_S:.0f} s")
        self.control, self.lock = None, None
        if control_file:
            from mitigation.control import ControlWriter, writer_lock
            self.lock, holder = writer_lock(control_file)
            if self.lock is None:
                self.say(f"another greyhound-trace{f' (pid {holder})' if holder else ''} "
                         f"writes plans to {control_file}: the controller's plans are "
                         "reported, not written")
            else:
                self.control = ControlWriter(control_file)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()   # validations to run here
        self.rendezvous: dict[int, Rendezvous] = {}  # request -> links between nodes
        self.ranks: dict[int, dict] = {}            # pid -> hello entry
        self.pending: dict[int, list[dict]] = {}    # pid -> iterations not yet published
        self.pending_calls: dict[int, list] = {}    # pid -> collectives not yet published
        self.buffered = 0
        self.dropped = 0                             # iterations that never left
        self.dropped_said = 0
        self.hello_due = True
        self.cmd_id: str | None = None
        self.epoch = 0
        self.acks_last = None
        self.published = 0
        self.events: list[dict] = []                # local events to forward
        self._offline_since: float | None = None if self.online else time.monotonic()
        self._next_try = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="greyhound-agent", daemon=True)
        self.thread.start()

    # -- the attach loop's side: cheap ------------------------------------------------

    def sink(self, ev: dict) -> None:
        if ev["kind"] in ("attach", "iteration") or ev["kind"] in FORWARDED:
            self.q.put(ev)

    def collectives(self, by_rank: dict[int, list]) -> None:
        """The local analysis's shared collectives (JobAnalysis.
        shared_collectives), per rank."""
        if by_rank:
            self.q.put({"kind": "collectives", "ranks": by_rank})

    def take_requests(self) -> list[dict]:
        """The controller's validation requests for this node (the attach
        loop runs them as its own, on the node's ranks)."""
        out = []
        while True:
            try:
                out.append(self.requests.get_nowait())
            except queue.Empty:
                return out

    def validated(self, request: int, result: dict) -> None:
        """A request's measurements, for the controller."""
        self.q.put({"kind": "validated", "request": request, "result": result})

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.thread.join(timeout)
        if self.lock is not None:
            self.lock.close()

    # -- the agent's thread ---------------------------------------------------------

    def _run(self) -> None:
        next_hb = next_acks = 0.0
        while True:
            stopping = self._stop.is_set()
            self._drain()
            now = time.monotonic()
            if self.online or now >= self._next_try:
                try:
                    if not self.online:
                        self.bus.r.ping()
                        self._back()
                    self._flush()
                    if now >= next_hb or stopping:
                        self.bus.publish("heartbeat", self.now_ns(), dropped=self.dropped,
                                         buffered=self.buffered, stopping=stopping)
                        next_hb = now + HEARTBEAT_S
                    if now >= next_acks:
                        self._acks()
                        next_acks = now + ACKS_S
                    if stopping:
                        return
                    self._commands(block_ms=int(BATCH_S * 1000))
                    continue
                except Exception as e:               # redis errors, sockets, TLS
                    self._gone(e)
                    self._next_try = time.monotonic() + RETRY_S
            if stopping:
                return
            self._stop.wait(BATCH_S)

    def _gone(self, e: Exception) -> None:
        if self.online:
            self.online = False
            self._offline_since = time.monotonic()
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.say(f"redis at {self.ep.where} lost ({why}): tracing locally, the last plan "
                     f"stays in force; trying again every {RETRY_S:.0f} s")

    def _back(self) -> None:
        away = time.monotonic() - (self._offline_since or time.monotonic())
        self.online, self._offline_since = True, None
        self.hello_due = True
        if self.dropped > self.dropped_said:
            self.bus.publish("gap", self.now_ns(), dropped=self.dropped - self.dropped_said,
                             away_s=round(away, 1))
            self.dropped_said = self.dropped
        self.say(f"redis at {self.ep.where} is back after {away:.0f} s")

    def _drain(self) -> None:
        while True:
            try:
                ev = self.q.get_nowait()
            except queue.Empty:
                return
            kind = ev["kind"]
            if kind == "attach":
                for d in ev.get("ranks", ()):
                    pid = int(d["pid"])
                    self.ranks[pid] = {k: d.get(k) for k in
                                       ("pid", "rank", "local_rank", "world_size", "comm")}
                    self.ranks[pid].update(start_time=_start_time(pid), netns=_netns(pid))
                    self.hello_due = True
            elif kind == "iteration":
                self._buffer(ev)
            elif kind == "collectives":
                for rank, items in ev["ranks"].items():
                    if (pid := self._pid_of(rank)) is not None:
                        held = self.pending_calls.setdefault(pid, [])
                        held.extend([list(x) for x in items])
                        del held[:-KEEP_CALLS]
            elif kind in ("validated", "links_store"):
                self.events.append(ev)
            else:
                if kind == "exit" and self.ranks.pop(int(ev.get("pid", -1)), None):
                    self.hello_due = True
                self._forward(ev)

    def _pid_of(self, rank) -> int | None:
        return next((p for p, d in self.ranks.items() if d["rank"] == rank), None)

    def _buffer(self, ev: dict) -> None:
        pid = self._pid_of(ev.get("rank"))
        if pid is None:
            return                   # not a rank (no RANK): nothing the job-wide view can use
        item = {k: ev[k] for k in ITERATION_FIELDS if k in ev}
        if ev.get("disturbed"):
            item["disturbed"] = ev["disturbed"]
        self.pending.setdefault(pid, []).append(item)
        self.buffered += 1
        while self.buffered > MAX_BUFFERED:
            longest = max(self.pending.values(), key=len)
            longest.pop(0)
            self.buffered -= 1
            self.dropped += 1

    def _forward(self, ev: dict) -> None:
        self.events.append(ev)
        if len(self.events) > 1000:                 # away for long: the latest are kept
            self.dropped += len(self.events) - 1000
            del self.events[:-1000]

    def _flush(self) -> None:
        t = self.now_ns()
        if self.hello_due:
            self.bus.hello(t, sorted(self.ranks.values(), key=lambda d: d["pid"]))
            self.hello_due = False
        batch = {pid: items for pid, items in sorted(self.pending.items()) if items}
        if batch:
            self.bus.iterations(t, batch)
            n = sum(map(len, batch.values()))
            self.buffered -= n
            self.published += n
            self.pending = {}
        if self.pending_calls:
            self.bus.publish("collectives", t, ranks={str(p): v for p, v in
                                                      sorted(self.pending_calls.items())})
            self.pending_calls = {}
        while self.events:
            ev = self.events[0]
            if ev["kind"] == "validated":
                self.bus.publish("validated", t, request=ev["request"], result=ev["result"])
            elif ev["kind"] == "links_store":
                self.bus.publish("links_store", t, request=ev["request"], addr=ev["addr"],
                                 port=ev["port"])
            elif ev["kind"] == "activity":
                self.bus.publish("activity", ev["time_ns"], **{k: ev[k] for k in (
                    "id", "what", "start_ns", "end_ns")})
            else:
                self.bus.publish("event", ev["time_ns"], event=ev)
            self.events.pop(0)

    def _acks(self) -> None:
        if self.control is None:
            return
        docs, cost = self.control.ack_docs(), self.control.restart_observed_s()
        if (docs, cost) != self.acks_last:
            self.bus.publish("acks", self.now_ns(), docs={str(r): d for r, d in docs.items()},
                             restart_observed_s=cost)
            self.acks_last = (docs, cost)

    # -- the controller's commands -------------------------------------------------------

    def _commands(self, block_ms: int) -> None:
        r = self.bus.r
        if self.cmd_id is None:
            # From the newest command on; the newest plan (if this node's
            # control file lacks it: a node that joined late) first.
            last = r.xrevrange(self.cmd_stream, count=100)
            self.cmd_id = _text(last[0][0]) if last else "0-0"
            for mid, raw in last:
                if _text(raw.get(b"kind", raw.get("kind", b""))) == "plan":
                    self._command(_text(mid), raw)
                    break
            return
        resp = r.xread({self.cmd_stream: self.cmd_id}, count=100, block=block_ms) or []
        for _, entries in resp:
            for mid, raw in entries:
                self.cmd_id = _text(mid)
                self._command(self.cmd_id, raw)

    def _command(self, mid: str, raw: dict) -> None:
        f = {_text(k): _text(v) for k, v in raw.items()}
        epoch = int(f.get("epoch", 0))
        data = json.loads(f.get("data", "{}"))
        if epoch < self.epoch:
            self.say(f"command {mid} from controller epoch {epoch} ignored: epoch "
                     f"{self.epoch} leads now")
            return
        self.epoch = epoch
        if f.get("kind") == "plan":
            self._plan(data)
        elif f.get("kind") == "validate":
            self._validate(data)
        elif f.get("kind") == "links":
            self._links(data)
        elif f.get("kind") == "links_join" and int(data["id"]) in self.rendezvous:
            self.rendezvous[int(data["id"])].set(data["addr"], data["port"])

    def _plan(self, d: dict) -> None:
        seq, strategy = int(d["seq"]), d["strategy"]
        if self.control is None:
            self.say(f"controller's plan {seq}: {strategy} (no --control-file: not written)")
            return
        if seq <= self.control.seq:
            return                                  # written already
        from mitigation.control import PlanError
        plan = dict(d.get("plan") or {})
        if "microbatches" in plan:
            plan["microbatches"] = {int(k): v for k, v in plan["microbatches"].items()}
        try:
            self.control.issue(strategy, seq=seq, reason=d.get("reason", ""), **plan)
        except (OSError, PlanError) as e:
            self.say(f"could not write the controller's plan {seq}: {e}")
            self.bus.publish("plan_written", self.now_ns(), seq=seq, error=str(e))
            return
        self.say(f"controller's plan {seq} ({strategy}) written to {self.control.path}")
        self.bus.publish("plan_written", self.now_ns(), seq=seq, error=None)

    def _validate(self, d: dict) -> None:
        """The part of a request measurable here: this node's devices, and
        the edges with both ends on it (nothing here: an empty answer, so
        that the controller does not wait)."""
        mine = {r["rank"] for r in self.ranks.values() if r.get("rank") is not None}
        devices = [r for r in d.get("devices", []) if r in mine]
        edges = [e for e in d.get("edges", []) if e[0] in mine and e[1] in mine]
        if not devices and not edges:
            self.validated(int(d["id"]), {})
            return
        self.say(f"the controller asks this node to validate {len(devices)} device(s) and "
                 f"{len(edges)} link(s) (request {d['id']})")
        self.requests.put({"id": int(d["id"]), "ranks": sorted(mine), "devices": devices,
                           "edges": edges, "reason": d.get("reason", "the controller asks"),
                           "suspects": [r for r in d.get("suspects") or [] if r in mine]})

    def _links(self, d: dict) -> None:
        """This node's side of the links between nodes (`group`: every rank
        measuring, on any node; `edges`: the edges between nodes)."""
        mine = {r["rank"] for r in self.ranks.values() if r.get("rank") is not None}
        here = sorted(mine & set(d["group"]))
        if not here:
            return
        rid = int(d["id"])
        for old in [k for k in self.rendezvous if k < rid - 10]:
            del self.rendezvous[old]
        rv = self.rendezvous[rid] = Rendezvous(lambda addr, port: self.q.put(
            {"kind": "links_store", "request": rid, "addr": addr, "port": port}))
        edges = [e for e in d["edges"] if e[0] in mine or e[1] in mine]
        self.say(f"the controller asks this node to measure {len(edges)} link(s) to other "
                 f"nodes (request {rid})")
        self.requests.put({"id": rid, "ranks": here, "devices": [], "edges": [],
                           "cross": {"group": d["group"], "edges": d["edges"], "rendezvous": rv},
                           "what": f"this node's side of {len(edges)} link(s) between nodes",
                           "reason": "the controller asks"})
