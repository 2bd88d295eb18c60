"""JobAnalysis: the whole chain after the probes, pure.

    Calls ------> JobPipeline (iterations, slowdowns) --+--> PassiveDiagnoser --+
    Targets       Topology (communicator map)           |                       v
    Activity ---> ActivityLog (Greyhound's own spans)   +--> ValidationPlanner --> `validation` request
    Validated ------------------------------------------------> rules.decide --> `diagnosis` (validation)
    Acks, PlanWritten, Tick ----------------------------------> SkiRentalPolicy -> `action`, `applied`

It does no I/O, starts no threads and never reads the clock: every input
carries its time (`t_ns`, on the analysis clock: CLOCK_MONOTONIC shifted to
the wall clock once, at the start), and every event it emits is timed by
its data. Given the same inputs in the same order, it emits the same events.
`attach` (tracer + JobAnalysis + validator + control writer + outputs),
`replay` (a recording + JobAnalysis) and the cluster controller all run it;
`attach --record FILE` records its inputs (greyhound_bpf.recording).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .diagnosis.bandwidth import BandwidthFloor
from .diagnosis.callcross import CallCross
from .diagnosis.crosssection import CrossSection
from .diagnosis.passive import PassiveDiagnoser
from .diagnosis.planner import PAUSE_BUDGET, ValidationPlanner
from .diagnosis.rules import Result, decide, edges_of
from .diagnosis.verdict import Diagnosis
from .engine.activity import ActivityLog
from .engine.detector import MIN_PROBABILITY, SLOWDOWN_THRESHOLD
from .engine.iterations import IterationRecord
from .engine.pipeline import JobPipeline
from .engine.topology import Topology
from .events import make_event
from .probe.catalog import Catalog
from mitigation.policy import RESTART_ESTIMATE_S, SkiRentalPolicy

# Attaching uprobes and the tracer's own start-up slow a job on a small host
# for a moment after the probes are in: iterations until then are ours.
SETTLE_S = 2.0
# A passive verdict the same as one given this recently (by the other
# passive method) in the same episode (no job recovery since) is not said
# again. Validation verdicts answer a request: always said.
SAME_VERDICT_S = 60.0
# Events that carry the `episode` they belong to.
EPISODE_KINDS = frozenset({"slowdown", "recovery", "diagnosis", "validation", "action",
                           "applied"})


# -- inputs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Calls:
    """One tracer batch (probe.records.CALL_DTYPE), `start_ns` already on the
    analysis clock."""
    t_ns: int
    recs: np.ndarray


@dataclass(frozen=True)
class Targets:
    """Processes probed from now on (`added`: pid, rank, local_rank,
    world_size, comm) or gone (`exited`: pids). `begin_ns`: when attaching
    them began."""
    t_ns: int
    added: tuple = ()
    exited: tuple = ()
    begin_ns: int | None = None


@dataclass(frozen=True)
class Activity:
    """A span of Greyhound's own activity that can touch the job
    (engine.activity.WHAT), opened (end_ns None) or closed."""
    t_ns: int
    id: str
    what: str
    start_ns: int
    end_ns: int | None = None


@dataclass(frozen=True)
class Validated:
    """The validator's measurements for a request (diagnosis.rules.Result)."""
    t_ns: int
    request: int
    result: dict


@dataclass(frozen=True)
class Acks:
    """The trainer's acknowledgements (`<control>.ack.<rank>`), when they changed."""
    t_ns: int
    docs: dict
    restart_observed_s: float | None = None


@dataclass(frozen=True)
class PlanWritten:
    """Writing plan `seq` to the control file failed (`error`), or worked."""
    t_ns: int
    seq: int
    error: str | None = None


@dataclass(frozen=True)
class Iterations:
    """One rank's iterations as another analysis found them in its calls
    (a node's agent publishes these; the job's controller takes them in
    place of calls). `key`: the target's pid (unique across nodes as the
    controller numbers them); `items`: IterationRecord fields, one dict each."""
    t_ns: int
    key: int
    items: tuple = ()


@dataclass(frozen=True)
class Communicators:
    """A node's communicator map (its agent's `topology` event): the
    controller's map is the merge of its nodes' (engine.topology.merge_maps)."""
    t_ns: int
    node: str
    fields: dict


@dataclass(frozen=True)
class Tick:
    """Time passes (once a second): waits that end, the communicator map."""
    t_ns: int


@dataclass(frozen=True)
class Collectives:
    """Ranks' blocking collectives as another analysis found them, one
    batch (a node's agent publishes those of a job sparse in them, for the
    call-by-call look; diagnosis.callcross): per key (as Iterations'), its
    (gap_ns or None, start_ns, end_ns) tuples."""
    t_ns: int
    calls: dict


INPUTS = (Calls, Targets, Activity, Validated, Acks, PlanWritten, Tick, Iterations,
          Communicators, Collectives)


@dataclass
class AnalysisConfig:
    threshold: float = SLOWDOWN_THRESHOLD
    min_probability: float = MIN_PROBABILITY
    validate: bool = True
    pause_budget: float = PAUSE_BUDGET
    mitigate: bool = False                  # plans go to the control file (else advised)
    plan_tests: bool = True                 # a plan run as predicted confirms its verdict
    first_seq: int = 1                      # the control file's next plan number
    microbatches: int | None = None
    restart_estimate_s: float = RESTART_ESTIMATE_S

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "AnalysisConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class _PlanInFlight:
    seq: int
    strategy: str
    expected_ms: float | None
    issued_ns: int


@dataclass
class _Rank:
    pid: int
    rank: int | None
    local_rank: int | None = None
    world_size: int | None = None
    comm: str = ""
    exited: bool = False


class JobAnalysis:
    def __init__(self, catalog: Catalog, job: str, config: AnalysisConfig | None = None):
        self.catalog, self.job = catalog, job
        self.config = c = config or AnalysisConfig()
        self.activity = ActivityLog()
        self.pipeline = JobPipeline(catalog, threshold=c.threshold,
                                    min_probability=c.min_probability, activity=self.activity)
        self.topology = Topology(catalog)
        self.passive = PassiveDiagnoser(topology=self.topology, activity=self.activity)
        self.cross = CrossSection()
        self.callcross = CallCross(catalog, activity=self.activity)
        self.bandwidth = BandwidthFloor(catalog, topology=self.topology, activity=self.activity)
        self.planner = ValidationPlanner(enabled=c.validate, budget=c.pause_budget)
        self.policy = SkiRentalPolicy(global_microbatches=c.microbatches,
                                      restart_estimate_s=c.restart_estimate_s,
                                      validate=c.validate)
        self.mode = "mitigate" if c.mitigate else "advise"
        self.next_seq = c.first_seq
        self.ranks: dict[int, _Rank] = {}          # pid -> identity
        self.now_ns = 0
        self.plan: _PlanInFlight | None = None      # issued, waiting for every rank's ack
        self.outcome_due: _PlanInFlight | None = None
        self.acks_seen: dict = {}
        self.diagnoses: list[Diagnosis] = []        # every verdict, in order
        self.recovered_ns = 0                        # the job's last recovery
        self.requests: dict[int, dict] = {}         # validation requests, by id
        self.episode: int | None = None              # open episode (events' `episode`)
        self.episodes = 0
        self._request_episode: dict = {}

    # -- the one entry point ---------------------------------------------------------

    def feed(self, inp) -> list[dict]:
        """Take one input; return the events it caused, in order."""
        self.now_ns = max(self.now_ns, int(inp.t_ns))
        handler = {Calls: self._calls, Targets: self._targets, Activity: self._activity,
                   Validated: self._validated, Acks: self._acks, PlanWritten: self._written,
                   Tick: self._tick, Iterations: self._iterations,
                   Communicators: self._communicators,
                   Collectives: self._collectives}.get(type(inp))
        if handler is None:
            raise TypeError(f"not an analysis input: {inp!r}")
        return handler(inp)

    # -- read-only views (for the live view and summaries) ----------------------------

    def rank_of(self) -> dict[int, int | None]:
        return {pid: r.rank for pid, r in self.ranks.items()}

    def live_ranks(self) -> list[_Rank]:
        return [r for _, r in sorted(self.ranks.items()) if not r.exited and r.rank is not None]

    def rank_view(self, pid: int) -> dict:
        return self.pipeline.rank_view(pid)

    @property
    def job_iterations(self) -> int:
        return self.pipeline.job_iterations

    @property
    def straggler(self) -> int | None:
        return self.policy.straggler

    @property
    def paused_total_s(self) -> float:
        return self.planner.paused_total_s

    # -- inputs ---------------------------------------------------------------------

    def _event(self, kind: str, t_ns: int, **fields) -> dict:
        if kind in EPISODE_KINDS:
            fields["episode"] = self._episode(kind, fields)
        return make_event(kind, self.job, t_ns, **fields)

    def _episode(self, kind: str, f: dict) -> int | None:
        """The episode an event belongs to: one opens with a job slowdown
        or a named verdict and closes with the job's recovery; a validation's
        verdict belongs to its request's, and a plan to the latest."""
        job = f.get("scope") == "job"
        if kind == "diagnosis" and f.get("evidence") == "validation":
            req = (f.get("details") or {}).get("request")
            if req in self._request_episode:
                return self._request_episode.pop(req)
        if self.episode is None and (kind == "slowdown" and job or
                                     kind == "diagnosis" and f.get("cause") != "unknown"):
            self.episodes += 1
            self.episode = self.episodes
        ep = self.episode
        if kind == "recovery" and job:
            self.episode = None
        if kind == "validation" and f.get("phase") == "request":
            self._request_episode[f.get("id")] = ep
        if ep is None and kind in ("action", "applied"):
            return self.episodes or None
        return ep

    def _targets(self, inp: Targets) -> list[dict]:
        for d in inp.added:
            pid = int(d["pid"])
            self.ranks[pid] = _Rank(pid, d.get("rank"), d.get("local_rank"),
                                    d.get("world_size"), d.get("comm", ""))
            self.pipeline.add_rank(pid, d.get("rank"))
        worlds = {r.world_size for r in self.ranks.values() if r.world_size} \
            if self.policy.world is None else ()
        if len(worlds) == 1:
            # --microbatches without a trainer's acks: the world from the ranks.
            self.policy.world = worlds.pop()
        for pid in inp.exited:
            if pid in self.ranks:
                self.ranks[pid].exited = True
                self.pipeline.retire(pid)
        if inp.added and inp.begin_ns is not None:
            # Attaching perturbs the job (and the ranks already traced) for
            # a moment: iterations until it has passed are ours. (A target
            # of an older recording has no attach time: nothing is marked.)
            self.activity.update(f"attach-{inp.t_ns}", "attach", inp.begin_ns,
                                 inp.t_ns + int(SETTLE_S * 1e9))
        return []

    def _calls(self, inp: Calls) -> list[dict]:
        recs = inp.recs
        if len(recs) == 0:
            return []
        rank_of = self.rank_of()
        self.topology.feed(recs, rank_of)
        out = self._engine(self.pipeline.feed_records(recs, rank_of))
        self.callcross.locked({rs.rank: rs.estimator.state == "locked"
                               for rs in self.pipeline.ranks.values()})
        return out + self._verdicts(self.bandwidth.feed(recs, rank_of) +
                                    self.callcross.feed(recs, rank_of), inp.t_ns)

    def _iterations(self, inp: Iterations) -> list[dict]:
        r = self.ranks.get(inp.key)
        self.pipeline.add_rank(inp.key, r.rank if r else None)
        items = [IterationRecord.from_fields(r.rank if r else None, d)
                 for d in inp.items
                 if not d.get("disturbed")]       # the agent's own activity: not the job's
        return self._engine(self.pipeline.feed_iterations(inp.key, items))

    def _collectives(self, inp: Collectives) -> list[dict]:
        by_rank = {r.rank: items for key, items in inp.calls.items()
                   if (r := self.ranks.get(key)) is not None and r.rank is not None}
        return self._verdicts(self.callcross.take(by_rank), inp.t_ns)

    def shared_collectives(self) -> dict[int, list[tuple]]:
        """Per rank, its collectives since the last call where the job is
        sparse in them: what a node's agent sends the job's controller."""
        return self.callcross.shared()

    def _activity(self, inp: Activity) -> list[dict]:
        self.activity.update(inp.id, inp.what, inp.start_ns, inp.end_ns)
        if inp.what == "pause" and inp.end_ns is not None:
            self.planner.pause(inp.start_ns, inp.end_ns)
        return [self._event("activity", inp.t_ns, id=inp.id, what=inp.what,
                            start_ns=inp.start_ns, end_ns=inp.end_ns)]

    def _validated(self, inp: Validated) -> list[dict]:
        req = self.requests.pop(inp.request, None)
        index = req["index"] if req else None
        v = decide(Result.from_dict(inp.result), index)
        v = v.but(details={**v.details, "request": inp.request})
        self.planner.done(inp.request, v, inp.t_ns)
        return self._verdicts([v], inp.t_ns) + self._planner_tick(inp.t_ns)

    def _acks(self, inp: Acks) -> list[dict]:
        docs = {int(r): d for r, d in inp.docs.items()}
        self.acks_seen = docs
        self.policy.acks(docs)
        work = {r: d.get("microbatches") for r, d in docs.items()}
        self.cross.work(work)
        self.callcross.work(work)
        self.policy.restart_observed_s = inp.restart_observed_s
        p = self.plan
        if p is None or not docs:
            return []
        done = sorted(r for r, d in docs.items() if int(d.get("seq", 0)) >= p.seq)
        if len(done) < len(docs):
            return []
        self.plan = None
        # The ranks switched splits between their first and last ack: the
        # iterations across that are neither split's speed.
        applied = [int(d.get("applied_ns", inp.t_ns)) for r, d in docs.items() if r in done]
        self.activity.update(f"plan-{p.seq}", "plan", min(applied), max(applied) + 1)
        ev = self._event("applied", inp.t_ns, seq=p.seq, ranks=done,
                         after_ms=round((inp.t_ns - p.issued_ns) / 1e6, 1))
        out = [ev] + self._observe(ev)
        if p.strategy == "rebalance_microbatches":
            self.outcome_due = p
        return out

    def _written(self, inp: PlanWritten) -> list[dict]:
        if inp.error is None:
            return []
        # The control file cannot be written: advise only from now on (the
        # trainer keeps the last plan it read).
        self.mode = "advise"
        self.policy.withdraw()
        if self.plan is not None and self.plan.seq == inp.seq:
            self.plan = None
        return [self._event("action", inp.t_ns, strategy="none", seq=None, mode="advise",
                            plan={}, expected_ms=None,
                            reason=f"could not write plan {inp.seq} to the control file "
                                   f"({inp.error}): advising only from now on")]

    def _communicators(self, inp: Communicators) -> list[dict]:
        self.topology.merge(inp.node, inp.fields)
        return []                       # (the job's map: a `topology` event at the next tick)

    def _tick(self, inp: Tick) -> list[dict]:
        out = []
        topo = self.topology.changed()
        if topo:
            out.append(self._event("topology", inp.t_ns, **topo))
        out += self._planner_tick(inp.t_ns)
        # Is the fault the plan in force works around gone? A measurement
        # of its device, or (validation off) a trial at the even split.
        rank = self.policy.recheck_due(inp.t_ns)
        if rank is not None:
            asked = self.planner.recheck(self._job_rank(rank), inp.t_ns)
            if not any(f["phase"] == "request" for f in asked):
                self.policy.recheck_refused(inp.t_ns)    # a trial instead
            out += self._validation_events(asked, inp.t_ns)
        out += self._actions(self.policy.trial_due(inp.t_ns), inp.t_ns)
        return out

    def _job_rank(self, dp_rank: int) -> int:
        """The job rank of a data-parallel rank (the trainer's acks say)."""
        for r, d in self.acks_seen.items():
            if d.get("dp_rank", r) == dp_rank:
                return r
        return dp_rank

    # -- the chain after the engine ---------------------------------------------------

    def _engine(self, found: list[tuple[str, dict, int]]) -> list[dict]:
        """The engine's (kind, fields, time) items as events, each followed
        by what it causes downstream."""
        out = []
        for kind, fields, t_ns in found:
            if kind == "iteration":
                self.callcross.iteration(fields.get("rank"), fields["start_ns"], t_ns)
            ev = self._event(kind, t_ns, **fields)
            out += [ev] + self._observe(ev)
        return out

    def _observe(self, ev: dict) -> list[dict]:
        """Diagnosis and policy for one event of the stream."""
        t = ev["time_ns"]
        if ev["kind"] in ("slowdown", "recovery"):
            self.planner.observe(ev)
            if ev["kind"] == "recovery" and ev.get("scope") == "job":
                self.recovered_ns = t
        out = self._verdicts(self.passive.observe(ev) + self.cross.observe(ev), t)
        out += self._mitigate(ev)
        return out

    def _verdicts(self, verdicts: list[Diagnosis], t_ns: int) -> list[dict]:
        out = []
        for v in verdicts:
            if self._said_already(v, t_ns):
                continue
            self.diagnoses.append(v)
            # Stamped when its evidence ends (a speed sample's, a call's).
            ev = self._event("diagnosis", v.details["at_ns"], **v.fields())
            out.append(ev)
            acts = self._mitigate(ev)
            out += acts
            if v.evidence == "passive":
                # A plan made on this verdict tests it (diagnosis.planner).
                plan = next((a["seq"] for a in acts if self.config.plan_tests
                             and a["kind"] == "action"
                             and a.get("seq") is not None
                             and a.get("strategy") == "rebalance_microbatches"), None)
                out += self._validation_events(self.planner.consider(v, t_ns, plan), t_ns)
        return out

    def _said_already(self, v: Diagnosis, t_ns: int) -> bool:
        """A cross-sectional verdict that a passive verdict of the same
        evidence gave in the last SAME_VERDICT_S of this episode (or the
        reverse) adds nothing. A fault again on the same rank after the job
        recovered is a new fault, and a validation's verdict answers its
        request: both are always said (the policy and the planner need
        them)."""
        v.details.setdefault("at_ns", t_ns)
        if v.evidence == "validation":
            return False
        for old in reversed(self.diagnoses[-8:]):
            at = old.details.get("at_ns", t_ns)
            if (old.evidence == v.evidence and old.named and at >= self.recovered_ns and
                    (old.cause, old.ranks, old.link) == (v.cause, v.ranks, v.link) and
                    t_ns - at <= SAME_VERDICT_S * 1e9):
                return True
        return False

    def _planner_tick(self, t_ns: int) -> list[dict]:
        return self._validation_events(self.planner.tick(t_ns), t_ns)

    def _validation_events(self, reqs: list[dict], t_ns: int) -> list[dict]:
        out = []
        for f in reqs:
            if f["phase"] == "request":
                ranks = sorted(r.rank for r in self.live_ranks())
                if len(ranks) < 2:
                    self.planner.done(f["id"], Diagnosis("validation", "unknown", "one rank"),
                                      t_ns)
                    continue
                if f.get("devices"):
                    # A recheck: the device and a witness, no links.
                    witness = next(r for r in ranks if r not in f["devices"])
                    f = {**f, "ranks": ranks, "devices": sorted({*f["devices"], witness}),
                         "edges": []}
                else:
                    f = {**f, "ranks": ranks, "devices": ranks, "edges": [
                        list(e) for e in edges_of(self.topology.fields(), ranks)]}
                self.requests[f["id"]] = f
            out.append(self._event("validation", t_ns, **f))
        return out

    def _mitigate(self, ev: dict) -> list[dict]:
        t = ev["time_ns"]
        out = self._actions(self.policy.observe(ev), t)
        due = self.outcome_due
        pol = self.policy
        if (due and ev["kind"] == "iteration" and pol.since_plan >= pol.window
                and pol.recent_job_ms() is not None):
            self.outcome_due = None
            out.append(self._event("action", t, phase="outcome", seq=due.seq,
                                   strategy=due.strategy, expected_ms=due.expected_ms,
                                   achieved_ms=round(pol.recent_job_ms(), 3)))
        seq = self.planner.held_for()
        if seq is not None and ev["kind"] == "iteration" and self.plan is None \
                and (answer := pol.plan_measured()) is not None:
            out += self._validation_events(self.planner.plan_answer(seq, *answer, t), t)
        return out

    def _actions(self, decisions, t: int) -> list[dict]:
        out = []
        for d in decisions:
            seq = None
            if d.strategy != "none":
                if self.mode == "mitigate":
                    seq = self.next_seq
                    self.next_seq += 1
                    self.plan = _PlanInFlight(seq, d.strategy, d.expected_ms, t)
                else:
                    self.policy.withdraw()          # advise only: reported, not written
            out.append(self._event("action", t, seq=seq, mode=self.mode, **d.fields()))
        return out
