"""`greyhound-trace controller`: one JobAnalysis over every node's ranks.

    agents --XADD--> gh:{job}:ev:{node} --consumer group--> JobInputs --> JobAnalysis
                                                                             | plans
    agents <--XREAD-- gh:{job}:cmd <--(seq, epoch)-----------------------------+

Only the leader reads and plans. Leadership is a lease (`SET NX PX`,
renewed by a script that extends it only for its holder); each new leader
takes the next epoch (`INCR`) and stamps its plans with it, so agents drop
plans from a deposed leader once they have seen a newer one. A new leader
rebuilds the analysis from what the group had already delivered (muted:
nothing said twice, no plan written again), claims what was delivered but
never acknowledged, and goes on from there.

Inputs from different nodes arrive in batches a fraction of a second apart;
they are held HOLD_S after they arrive and fed in the order of their data's
times, a batch of iterations split into single iterations, so that the
job-level median compares the ranks' same iterations. A node silent for LOST_AFTER heartbeats is `agent_lost`:
its ranks leave the analysis (no verdict, no job median), and no plan is
written while it is away (its ranks could not acknowledge); a `hello` of a
new incarnation brings them back.
"""
from __future__ import annotations

import heapq
import json
import time
from dataclasses import dataclass

from ..analysis import (Activity, Collectives, Iterations, JobAnalysis, PlanWritten, Targets, Tick,
                        Validated)
from ..diagnosis.rules import keep_better, outliers
from ..events import make_event
from .agent import HEARTBEAT_S, RETRY_S
from .bus import ControllerBus, JobInputs, Message
from .identity import census, commands_stream

LOST_AFTER = 3                  # heartbeats
HOLD_S = 0.6                    # inputs wait this long for other nodes' of the same time
TICK_S = 1.0
DISCOVER_S = 2.0
LEASE_MS = 6000
CMD_MAXLEN = 10_000
KEEPALIVE_S = 1.0
VALIDATE_WAIT_S = 90.0          # for every node's answer (workers start, the job pauses)
READ_COUNT = 2000               # messages per read, over all streams: a turn stays short


class Lease:
    _RENEW = ("local v = redis.call('get', KEYS[1]) "
              "if v == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end "
              "if not v then return -1 end return 0")
    _RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
                "return redis.call('del', KEYS[1]) end return 0")
    # The next epoch, never below what this holder had (a Redis restarted
    # without its data starts the counter again).
    _EPOCH = ("local e = tonumber(redis.call('get', KEYS[1]) or '0') "
              "if e < tonumber(ARGV[1]) then redis.call('set', KEYS[1], ARGV[1]) end "
              "return redis.call('incrby', KEYS[1], 1)")

    def __init__(self, r, job: str, holder: str, ttl_ms: int = LEASE_MS):
        self.r, self.holder, self.ttl = r, holder, ttl_ms
        self.key, self.epoch_key = f"gh:{job}:leader", f"gh:{job}:epoch"
        self.epoch: int | None = None

    def acquire(self) -> int | None:
        """The new epoch if this holder now leads, else None."""
        if self.r.set(self.key, self.holder, nx=True, px=self.ttl):
            self.epoch = int(self.r.eval(self._EPOCH, 1, self.epoch_key, self.epoch or 0))
            return self.epoch
        return None

    def renew(self) -> bool:
        """Still leading. A lease that vanished (Redis restarted without its
        data) is taken again, in a new epoch, unless another took it first."""
        got = int(self.r.eval(self._RENEW, 1, self.key, self.holder, self.ttl))
        return got == 1 or got == -1 and self.acquire() is not None

    def release(self) -> None:
        self.r.eval(self._RELEASE, 1, self.key, self.holder)

    def leader(self) -> str | None:
        v = self.r.get(self.key)
        return v.decode() if isinstance(v, bytes) else v


@dataclass
class NodeState:
    incarnation: str
    seen: float                 # controller's monotonic clock, last message
    lost: bool = False
    dropped: int = 0


class Controller:
    def __init__(self, r, job: str, analysis: JobAnalysis, out, say, *, nodes=(),
                 consumer: str = "controller-1", epoch: int = 0, mitigate: bool = False,
                 now_ns=time.time_ns, keepalive=None, record=None):
        self.r, self.job, self.analysis, self.out, self.say = r, job, analysis, out, say
        self.bus = ControllerBus(r, job, list(nodes), consumer)
        self.inputs = JobInputs()
        self.nodes: dict[str, NodeState] = {}
        self.epoch, self.mitigate, self.now_ns = epoch, mitigate, now_ns
        # Called at least every KEEPALIVE_S while the controller works (the
        # lease is renewed through it while a long rebuild or backlog runs).
        self.keepalive, self._kept = keepalive, time.monotonic()
        self.record = record                 # every input of the analysis (--record)
        self.cmd = commands_stream(job)
        self.held: list = []                 # (t_ns, order, received, input)
        self.data_t: dict[str, int] = {}     # node -> the latest data time it sent
        self._order = 0
        self.muted = False
        self.census_said = None
        self.census_due = False
        self._where: dict | None = None      # rank -> node, from the hellos
        self.validations: dict[int, dict] = {}   # request -> nodes asked, their answers
        self.plans = 0
        self.write_failed = False
        self._next_tick = self._next_discover = self._last_turn = 0.0
        self.away = False

    # -- start: rebuild from what was delivered -----------------------------------------

    def start(self) -> int:
        """Find the nodes, rebuild from the group's history; the number of
        messages replayed."""
        self.bus.discover()
        old = self.bus.history()
        self.muted = True
        try:
            self._take(old)
            self._release(float("inf"))
            self._validations_done(float("-inf"))    # those answered in full
            self._release(float("inf"))
            if self.census_due:
                self._census(self.now_ns())
        finally:
            self.muted = False
        last = self.r.xrevrange(self.cmd, count=1)
        if last:
            seq = json.loads(_field(last[0][1], "data")).get("seq", 0)
            self.analysis.next_seq = max(self.analysis.next_seq, int(seq) + 1)
        return len(old)

    # -- one turn of the loop -----------------------------------------------------------

    def step(self, block_ms: int = 250) -> None:
        now = time.monotonic()
        busy = now - self._last_turn - block_ms / 1000
        if self._last_turn and busy > 0.5:
            # The controller itself was busy (a thousand hellos): the agents
            # were not silent for that long, it was not listening.
            for st in self.nodes.values():
                st.seen += busy
        self._last_turn = now
        if now >= self._next_discover:
            for n in self.bus.discover():
                self.say(f"reading node {n}'s stream")
            self._next_discover = now + DISCOVER_S
        msgs = self.bus.read(block_ms=block_ms,
                             count=max(1, READ_COUNT // max(1, len(self.bus.streams))))
        if self.away:
            self._redis_back()
        if self.bus.lost_groups:
            self.bus.lost_groups = False
            self._emit("gap", self.now_ns(), node=None, dropped=None, away_s=None,
                       reason="redis lost the streams (restarted without its data?): what the "
                              "agents sent before is gone, the analysis goes on from now")
        self._take(msgs)
        self.bus.ack(msgs)
        self._release(time.monotonic() - HOLD_S)
        now = time.monotonic()
        self._check_lost(now)
        self._validations_done(now)
        if now >= self._next_tick:
            # (the census once a second at most: a thousand nodes say hello
            # within a second or two)
            if self.census_due:
                self._census(self.now_ns())
            self._feed(Tick(self.now_ns()))
            self._next_tick = now + TICK_S

    def redis_away(self) -> None:
        """Redis could not be reached (the caller retries step())."""
        self.away = True

    def _redis_back(self) -> None:
        # The controller heard no one while redis was away: no agent's
        # silence counts from before its return, and each gets its own retry
        # period (RETRY_S) to reconnect on top of the usual LOST_AFTER.
        self.away = False
        now = time.monotonic()
        for st in self.nodes.values():
            st.seen = max(st.seen, now + RETRY_S)

    def _take(self, msgs: list[Message]) -> None:
        new = {id(m) for m in self.inputs.new(msgs)}    # then taken in time order
        for m in sorted(msgs, key=lambda m: (m.t_ns, m.node, m.seq)):
            if self.keepalive is not None and time.monotonic() - self._kept >= KEEPALIVE_S:
                self.keepalive()
                self._kept = time.monotonic()
            self._seen(m)
            if id(m) not in new:
                continue                         # delivered twice: taken already
            for inp in self.inputs.convert(m):
                self._hold(inp)
            if m.kind == "hello":
                self.census_due, self._where = True, None
            elif m.kind == "event":
                self._emit("node_event", m.t_ns, node=m.node, event=m.data.get("event"))
            elif m.kind == "gap":
                self._emit("gap", m.t_ns, node=m.node, **m.data)
            elif m.kind == "plan_written" and m.data.get("error"):
                self.write_failed = True
                self._hold(PlanWritten(m.t_ns, int(m.data["seq"]),
                                       f"node {m.node}: {m.data['error']}"))
            elif m.kind == "heartbeat" and m.data.get("stopping"):
                self._lose(m.node, m.t_ns, "agent_left")
            elif m.kind == "activity":
                d = m.data            # a node's validation pauses the whole job
                self._hold(Activity(m.t_ns, f"{m.node}:{d['id']}", d["what"], d["start_ns"],
                                    d.get("end_ns")))
            elif m.kind == "validated":
                req = int(m.data["request"])         # negative: a second look (_second_look)
                v = self.validations.get(abs(req))
                res = m.data.get("result") or {}
                if v is not None:
                    part = "again" if req < 0 else "links" if res.get("between_nodes") else "results"
                    v[part][m.node] = res
            elif m.kind == "links_store":
                self._links_store(m)

    def _hold(self, inp) -> None:
        if isinstance(inp, Iterations):
            node, now = self.inputs.node_of.get(inp.key), time.monotonic()
            end = 0
            for d in inp.items:          # one by one, in the order of their ends
                end = d["start_ns"] + d["dur_ns"]
                self._order += 1
                heapq.heappush(self.held, (end, self._order, now, Iterations(end, inp.key, (d,))))
            self.data_t[node] = max(self.data_t.get(node, 0), end)
        elif isinstance(inp, Collectives):   # at the time of their data, as iterations
            self._push(max(e for v in inp.calls.values() for _, _, e in v), inp)
        elif isinstance(inp, Targets) and inp.added:
            self._push(0, inp)               # before any iteration of its ranks
        else:
            self._push(inp.t_ns, inp)

    def _push(self, t_ns: int, inp) -> None:
        self._order += 1
        heapq.heappush(self.held, (t_ns, self._order, time.monotonic(), inp))

    def _release(self, received_before: float) -> None:
        """Fed in the order of their times, once the earliest has waited
        HOLD_S (what arrived within HOLD_S of each other is in order)."""
        while self.held and self.held[0][2] <= received_before:
            self._feed(heapq.heappop(self.held)[3])

    def _feed(self, inp) -> None:
        if self.keepalive is not None and time.monotonic() - self._kept >= KEEPALIVE_S:
            self.keepalive()
            self._kept = time.monotonic()
        if self.record is not None:
            self.record(inp)
        for ev in self.analysis.feed(inp):
            self._route(ev)

    # -- nodes ----------------------------------------------------------------------

    def _seen(self, m: Message) -> None:
        st, now = self.nodes.get(m.node), time.monotonic()
        if st is None or st.incarnation != m.incarnation:
            self.nodes[m.node] = NodeState(m.incarnation, now)
            self._emit("agent", m.t_ns, node=m.node, agent=m.incarnation, rejoined=st is not None)
            self._plans_allowed()
            return
        silent, st.seen = now - st.seen, now
        if st.lost and not (m.kind == "heartbeat" and m.data.get("stopping")):
            # Back, the same agent (stopped, or cut off from redis a while).
            st.lost = False
            self._emit("agent", m.t_ns, node=m.node, agent=m.incarnation, rejoined=True,
                       silent_s=round(max(silent, 0.0), 1))
            for inp in self.inputs.revive(m.node, m.t_ns):
                self._hold(inp)
            self.census_due, self._where = True, None
            self._plans_allowed()

    def _check_lost(self, now: float) -> None:
        for node, st in self.nodes.items():
            if not st.lost and now - st.seen > LOST_AFTER * HEARTBEAT_S:
                self._lose(node, self.now_ns(), "agent_lost", silent_s=round(now - st.seen, 1))

    def _lose(self, node: str, t_ns: int, kind: str, **extra) -> None:
        st = self.nodes.get(node)
        if st is None or st.lost:
            return
        st.lost = True
        ranks = sorted(d.get("rank") for d in self.inputs.present.get(node, {}).values()
                       if d.get("rank") is not None)
        self._emit(kind, t_ns, node=node, agent=st.incarnation, ranks=ranks, **extra)
        # Its ranks leave after the last of their iterations that arrived.
        for inp in self.inputs.lose(node, self.data_t.get(node, t_ns)):
            self._hold(inp)
        self.census_due, self._where = True, None
        self._plans_allowed()

    def _plans_allowed(self) -> None:
        """Plans are written only while every node's agent is there to
        write them and acknowledge them (and none failed to)."""
        if self.mitigate and not self.write_failed:
            away = any(st.lost for st in self.nodes.values())
            self.analysis.mode = "advise" if away else "mitigate"

    def _census(self, t_ns: int) -> None:
        self.census_due = False
        c = census(self.inputs.hellos())
        said = (c.complete, tuple(c.problems()))
        if said == self.census_said or c.world is None:
            return
        self.census_said = said
        self._emit("census", t_ns, world=c.world, complete=c.complete, problems=c.problems(),
                   where={r: ns for r, ns in sorted(c.where.items())})

    # -- events out ---------------------------------------------------------------------

    def node_of_rank(self, rank) -> str | None:
        if self._where is None:
            self._where = {d.get("rank"): node for node, ranks in self.inputs.present.items()
                           for d in ranks.values()}
        return self._where.get(rank)

    def _emit(self, kind: str, t_ns: int, **fields) -> None:
        if not self.muted:
            self.out(make_event(kind, self.job, t_ns, **fields))

    def _route(self, ev: dict) -> None:
        ranks = ev.get("ranks") if isinstance(ev.get("ranks"), list) else (
            [ev["rank"]] if ev.get("rank") is not None else [])
        nodes = sorted({n for n in map(self.node_of_rank, ranks) if n})
        if nodes:
            ev["nodes"] = nodes
        if ev["kind"] == "validation" and ev.get("phase") == "request":
            self._validate(ev)
        if self.muted:
            return
        self.out(ev)
        if ev["kind"] == "action" and ev.get("seq") is not None and ev.get("phase") != "outcome":
            self.r.xadd(self.cmd, {"kind": "plan", "epoch": self.epoch, "t": ev["time_ns"],
                                   "data": json.dumps({k: ev.get(k) for k in (
                                       "seq", "strategy", "plan", "reason")})},
                        maxlen=CMD_MAXLEN, approximate=True)
            self.plans += 1

    # -- validation: each node measures its own part -------------------------------------

    def _validate(self, ev: dict) -> None:
        """Ask the agents; each measures its node's devices and the edges
        inside it. Then (phase two, once they all answered) the edges
        between nodes, by workers on both ends (diagnosis.crosslinks)."""
        devices, edges = ev.get("devices") or [], ev.get("edges") or []
        node = self.node_of_rank
        asked = {node(r) for r in devices} | {node(a) for a, b in edges if node(a) == node(b)}
        self.validations[int(ev["id"])] = {
            "asked": self._present(asked), "results": {}, "again": {}, "links": {},
            "phase": "nodes", "looked": None,
            "across": sorted({(min(a, b), max(a, b)) for a, b in edges if node(a) != node(b)}),
            "until": time.monotonic() + VALIDATE_WAIT_S}
        self._command("validate", ev["time_ns"], {k: ev.get(k) for k in (
            "id", "devices", "edges", "reason", "suspects")})

    def _present(self, nodes) -> set:
        return {n for n in nodes if n and not self.nodes.get(n, NodeState("", 0)).lost}

    def _command(self, kind: str, t_ns: int, data: dict) -> None:
        if not self.muted:
            self.r.xadd(self.cmd, {"kind": kind, "epoch": self.epoch, "t": t_ns,
                                   "data": json.dumps(data)},
                        maxlen=CMD_MAXLEN, approximate=True)

    def _links_store(self, m: Message) -> None:
        v = self.validations.get(int(m.data["request"]))
        if v is not None and v["phase"] == "links":
            self._command("links_join", m.t_ns, {"id": int(m.data["request"]),
                                                 "addr": m.data["addr"], "port": m.data["port"]})

    def _validations_done(self, now: float) -> None:
        """Phases: `nodes` (each node its own part), `again` (a second look
        at a device that read slow on one pass), `links` (the edges between
        nodes), then the merged measurements go to the analysis."""
        for rid, v in list(self.validations.items()):
            if v["phase"] == "nodes" and (v["asked"] <= set(v["results"]) or now >= v["until"]):
                v["silent"] = sorted(v["asked"] - set(v["results"]))
                if not self._second_look(rid, v):
                    self._between_nodes(rid, v)
            if v["phase"] == "again" and (v["looked"] <= set(v["again"]) or now >= v["until"]):
                self._keep_better(v)
                self._between_nodes(rid, v)
            if v["phase"] == "done" or v["phase"] == "links" and (
                    v["asked"] <= set(v["links"]) or now >= v["until"]):
                del self.validations[rid]
                self._hold(Validated(self.now_ns(), rid, self._merged(v)))

    def _second_look(self, rid: int, v: dict) -> bool:
        """A device slower than the others measured once only (alone on its
        node: its node's validator had no witness to measure it beside),
        measured again with the fastest device as a witness, each keeping
        its better time, as one node's validator does with its own
        (diagnosis.validator): a busy moment of a shared host rarely hits
        the same device twice, a slow device is slow each time. Once per
        request; False when there is nothing to look at again."""
        if v["looked"] is not None:
            return False
        devices = {int(r): d for r, d in merge_results(v["results"], [])["devices"].items()}
        got = {r: d["ms_per_gemm"] for r, d in devices.items()
               if d.get("ms_per_gemm") is not None}
        if len(got) < 2:
            return False
        suspects = sorted(r for r in outliers(got)[2] if devices[r].get("passes", 1) < 2)
        witness = min(got, key=got.get)
        again = sorted(set(suspects) | {witness})
        looked = self._present({self.node_of_rank(r) for r in again})
        if not suspects or not looked:
            return False
        v.update(phase="again", looked=looked, until=time.monotonic() + VALIDATE_WAIT_S)
        if not self.muted:
            self.say(f"validation {rid}: rank(s) {', '.join(map(str, suspects))} measured slow "
                     f"on one pass: measured again, with rank {witness} (the fastest) as a witness")
        self._command("validate", self.now_ns(), {
            "id": -rid, "devices": again, "edges": [], "suspects": suspects,
            "reason": f"a second look at request {rid}'s slow device(s)"})
        return True

    @staticmethod
    def _keep_better(v: dict) -> None:
        """The second look's answers: each device keeps its better time;
        its pause counts among the node's (paused_s: the longest)."""
        for node, res in v["again"].items():
            if not res.get("devices") or node not in v["results"]:
                continue
            first = v["results"][node]
            mine = first.setdefault("devices", {})
            for r, d in res["devices"].items():
                mine[r] = keep_better(mine.get(r), d, "ms_per_gemm")
            first["paused_s"] = max(first.get("paused_s", 0), res.get("paused_s", 0))
            for k in ("seconds", "pauses"):
                first[k] = first.get(k, 0) + res.get(k, 0)
            first["untested"] = first.get("untested", []) + [
                f"second look: {u}" for u in res.get("untested", [])]

    def _between_nodes(self, rid: int, v: dict) -> None:
        """Phase two: the edges between nodes, by workers on both ends
        (diagnosis.crosslinks), when every node on them is here."""
        node = self.node_of_rank
        group = sorted({r for e in v["across"] for r in e})
        involved = {node(r) for r in group}
        if not v["across"] or involved != self._present(involved):
            v["phase"] = "done"
            return
        v.update(phase="links", asked=involved, until=time.monotonic() + VALIDATE_WAIT_S)
        self._command("links", self.now_ns(), {"id": rid, "group": group, "edges": v["across"]})

    def _merged(self, v: dict) -> dict:
        """Both phases' measurements as one, with the rank -> node map."""
        out, links = merge_results(v["results"], []), merge_results(v["links"], [])
        out["links"].update(links["links"])
        out["rounds"] += next((r["rounds"] for r in v["links"].values() if r.get("rounds")), [])
        out["untested"] += links["untested"]
        out["paused_s"] = max(out["paused_s"], links["paused_s"])
        for k in ("pauses", "seconds"):
            out[k] += links[k]
        node = self.node_of_rank
        out["untested"] = ([f"{a}<->{b}: between nodes {node(a)} and {node(b)}, not measured"
                            for a, b in v["across"] if f"{a}<->{b}" not in out["links"]]
                           + [f"node {n}: no answer in {VALIDATE_WAIT_S:.0f} s"
                              for n in v.get("silent", [])] + out["untested"])
        ranks = {int(r) for r in out["devices"]} | {r for e in v["across"] for r in e} | {
            int(r) for k in out["links"] for r in k.split("<->")}
        out["nodes"] = {str(r): node(r) for r in sorted(ranks) if node(r)}
        return out


def merge_results(by_node: dict[str, dict], untested: list[str]) -> dict:
    """The nodes' measurements (diagnosis.rules.Result dicts) as one."""
    out = {"devices": {}, "links": {}, "rounds": [], "untested": list(untested),
           "paused_s": 0.0, "pauses": 0, "seconds": 0.0, "measured_at_ns": None}
    for node in sorted(by_node):
        r = by_node[node]
        out["devices"].update(r.get("devices", {}))
        out["links"].update(r.get("links", {}))
        out["rounds"] += r.get("rounds", [])
        out["untested"] += [f"node {node}: {u}" for u in r.get("untested", [])]
        for k in ("paused_s", "pauses", "seconds"):
            out[k] = max(out[k], r.get(k, 0))
        at = r.get("measured_at_ns")
        if at is not None:
            out["measured_at_ns"] = min(at, out["measured_at_ns"] or at)
    return out


def _field(raw: dict, name: str) -> str:
    v = raw.get(name.encode(), raw.get(name))
    return v.decode() if isinstance(v, bytes) else v
