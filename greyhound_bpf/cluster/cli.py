"""The command line of many machines: `attach --cluster` (a node's agent)
and `greyhound-trace controller`. Standard library only at import (the
command line's rule: `attach` starts in the background before heavy
imports)."""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

from .. import GreyhoundError

EPILOG_CONTROLLER = """\
examples:
  export GREYHOUND_REDIS_PASSWORD=...      # or --cluster-secret FILE; never on argv
  greyhound-trace controller --cluster rediss://10.0.0.5:6380 --job run42 \\
      --cluster-ca ca.pem -o job.jsonl
  greyhound-trace controller --cluster rediss://10.0.0.5:6380 --job run42 \\
      --cluster-ca ca.pem --mitigate --microbatches 16
  # on each node (its agent):
  sudo -E greyhound-trace attach $(pgrep -f torchrun) --cluster rediss://10.0.0.5:6380 \\
      --node $(hostname -s) --cluster-ca ca.pem --control-file /run/ctl.json

Start two controllers for one job and the second waits as a standby: it
takes over (a new epoch; plans of the old leader are refused by agents
from then on) when the leader's lease lapses. Exit 0 on Ctrl-C, SIGTERM or
--duration; 1 when redis cannot be reached; 2 for bad input or refused
credentials.
"""


def add_connection_args(p, user_help: str) -> None:
    g = p.add_argument_group("redis (many machines)")
    g.add_argument("--cluster", metavar="URL",
                   help="the job's Redis: redis://HOST:PORT, or rediss://HOST:PORT for TLS")
    g.add_argument("--cluster-user", metavar="NAME", help=user_help)
    g.add_argument("--cluster-secret", metavar="FILE",
                   help="a file whose first line is the password (default: "
                        "$GREYHOUND_REDIS_PASSWORD; never on the command line)")
    g.add_argument("--cluster-ca", metavar="FILE", help="CA certificate(s) to check the server")
    g.add_argument("--cluster-cert", metavar="FILE", help="client certificate (PEM)")
    g.add_argument("--cluster-key", metavar="FILE", help="its private key (PEM)")
    return g


def add_agent_args(p) -> None:
    g = add_connection_args(p, "Redis user (default: agent-NODE)")
    g.add_argument("--node", metavar="NAME",
                   help="with --cluster: this node's name (letters, digits, ._-)")


def _endpoint(args, user: str):
    from .connect import endpoint
    return endpoint(args.cluster, args.cluster_user or user, args.cluster_secret,
                    args.cluster_ca, args.cluster_cert, args.cluster_key)


def job_from_environment(pids: list[int]) -> str | None:
    """The job's name from the environment of PID or its descendants."""
    from ..probe.discovery import all_stats, descendants, read_environ
    from .identity import job_identity
    for pid in descendants(pids, all_stats()):
        try:
            job = job_identity(read_environ(pid))
        except OSError:
            continue
        if job:
            return job
    return None


@dataclass
class AgentSetup:
    endpoint: object
    job: str
    node: str

    def start(self, session):
        """The agent of an attach session: its events go to Redis."""
        from ..diagnosis.announce import set_node
        from .agent import Agent
        set_node(self.node)          # this node's validation lock and state
        agent = Agent(self.endpoint, self.job, self.node, session.opts.control_file,
                      say=session.say)
        session.sinks.append(agent.sink)
        if session.writer:
            session.writer.stamp = {"node": self.node, "agent": agent.incarnation}
        session.say(f"agent of node {self.node} for job {self.job}: publishing to "
                    f"{self.endpoint.where}")
        return agent


def agent_setup(args, pids: list[int]) -> AgentSetup | None:
    if not args.cluster:
        if args.node:
            raise GreyhoundError("--node goes with --cluster URL")
        return None
    from .identity import IdentityError, check_name
    if not args.node:
        raise GreyhoundError("--cluster needs --node NAME: this node's name in the job")
    # The controller's options would do nothing on an agent: said, not dropped.
    theirs = [flag for flag, given in (("--mitigate", args.mitigate),
                                       ("--no-validate", args.no_validate),
                                       ("--always-validate", args.always_validate),
                                       ("--pause-budget", args.pause_budget is not None))
              if given]
    if theirs:
        raise GreyhoundError(
            f"{', '.join(theirs)}: with --cluster the controller validates and plans for the "
            f"whole job; give {'them' if len(theirs) > 1 else 'it'} to "
            "`greyhound-trace controller`")
    try:
        node = check_name("--node", args.node)
        job = check_name("--job", args.job) if args.job else job_from_environment(pids)
    except IdentityError as e:
        raise GreyhoundError(str(e)) from None
    if job is None:
        raise GreyhoundError(
            f"--cluster: PID {pids[0]}'s environment names no job (TORCHELASTIC_RUN_ID, "
            "SLURM_JOB_ID, MASTER_ADDR and MASTER_PORT): give --job NAME, the same on "
            "every node")
    return AgentSetup(_endpoint(args, f"agent-{node}"), job, node)


def add_controller_parser(sub, output_args, positive) -> None:
    import argparse

    from ..argtypes import fraction
    from ..diagnosis.planner import PAUSE_BUDGET
    c = sub.add_parser("controller", help="the job-wide view over every node's agent",
                       description="Read every node's agent (attach --cluster) through Redis\n"
                                   "Streams and run one analysis over all the job's ranks: one\n"
                                   "job-level detector, cross-node verdicts, one policy whose\n"
                                   "plans the agents write to their nodes' control files.",
                       epilog=EPILOG_CONTROLLER,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = add_connection_args(c, "Redis user (default: controller)")
    g.add_argument("--job", required=False, metavar="NAME",
                   help="the job (its agents' --job, or what they found in its environment)")
    g.add_argument("--nodes", metavar="A,B,...",
                   help="nodes to read from the start (others are found as they publish)")
    output_args(c, "JSON lines on stdout", "write JSON lines to FILE")
    c.add_argument("--iterations", action="store_true",
                   help="also write every rank's iterations to the JSON lines")
    c.add_argument("--duration", type=positive, metavar="S", help="stop after S seconds")
    c.add_argument("--record", metavar="FILE",
                   help="record every input of the job's analysis to FILE (.gz: compressed), "
                        "for greyhound-trace replay")
    c.add_argument("--no-validate", action="store_true",
                   help="never ask the agents to measure devices and links (verdicts are "
                        "then passive only)")
    c.add_argument("--mitigate", action="store_true",
                   help="publish plans for the agents to write to their control files "
                        "(else advise only)")
    c.add_argument("--always-validate", action="store_true",
                   help="validate a verdict even when the plan made on it ran as predicted "
                        "(by default that confirms it: no pause)")
    c.add_argument("--pause-budget", type=fraction, default=PAUSE_BUDGET, metavar="F",
                   help="most of any 10 minutes validation may keep the job paused "
                        f"(default {PAUSE_BUDGET:g}: 1%%)")
    c.add_argument("--microbatches", type=int, metavar="M",
                   help="the global batch in micro-batches (else from the trainers' acks)")
    c.add_argument("--restart-cost", type=positive, default=60.0, metavar="S",
                   help="what a checkpoint-restart costs the job, until one is measured")


def cmd_controller(args, json_target) -> int:
    from .identity import IdentityError, check_name
    if not args.cluster or not args.job:
        raise GreyhoundError("controller needs --cluster URL and --job NAME")
    try:
        job = check_name("--job", args.job)
        nodes = [check_name("--nodes", n) for n in (args.nodes or "").split(",") if n]
    except IdentityError as e:
        raise GreyhoundError(str(e)) from None
    ep = _endpoint(args, "controller")
    from ..analysis import AnalysisConfig, JobAnalysis
    from ..output.jsonl import JsonLinesWriter
    from ..output.text import describe
    from ..probe.catalog import load_catalog
    from .connect import check, client
    from .controller import LEASE_MS, Controller, Lease
    r = client(ep)
    check(r, ep)
    out_path = json_target(args)
    writer = JsonLinesWriter(out_path) if out_path else None
    text = sys.stderr if out_path == "-" else sys.stdout

    def say(msg):
        print(f"greyhound-trace: {msg}", file=text, flush=True)

    def out(ev):
        if writer and (ev["kind"] != "iteration" or args.iterations):
            writer.write(ev)
        line = describe(ev) if ev["kind"] not in ("iteration", "node_event") else None
        if line:
            nodes = f" [node {', '.join(ev['nodes'])}]" if ev.get("nodes") else ""
            print(line + nodes, file=text, flush=True)

    config = AnalysisConfig(validate=not args.no_validate, mitigate=args.mitigate,
                            microbatches=args.microbatches, restart_estimate_s=args.restart_cost,
                            plan_tests=not args.always_validate,
                            pause_budget=args.pause_budget)
    catalog = load_catalog()
    analysis = JobAnalysis(catalog, job, config)    # (seconds of imports: before leading)
    recorder = None
    if args.record:
        from ..recording import Recorder, header
        recorder = Recorder(args.record, header(job, config, catalog, producer="controller"),
                            catalog)
    holder = f"{socket.gethostname()}-{os.getpid()}"
    lease = Lease(r, job, holder)
    stop = time.monotonic() + args.duration if args.duration else None
    ctl = None
    try:
        said_standby = False
        while lease.acquire() is None:
            if not said_standby:
                say(f"standby: {lease.leader()} leads job {job}; taking over if it stops")
                said_standby = True
            if stop and time.monotonic() >= stop:
                return 0
            time.sleep(LEASE_MS / 3000)
        renew = [time.monotonic() + LEASE_MS / 3000]

        def keepalive():
            if time.monotonic() >= renew[0]:
                was = lease.epoch
                if not lease.renew():
                    raise GreyhoundError(f"lost the lead of job {job} (epoch {lease.epoch}): "
                                         "another controller leads now")
                if lease.epoch != was and ctl is not None:
                    say(f"the lease was gone from redis: leading again as epoch {lease.epoch}")
                    ctl.epoch = lease.epoch
                    if writer:
                        writer.stamp = {"producer": f"controller:{holder}:{lease.epoch}"}
                renew[0] = time.monotonic() + LEASE_MS / 3000
        ctl = Controller(r, job, analysis, out, say, nodes=nodes, consumer=holder,
                         epoch=lease.epoch, mitigate=args.mitigate, keepalive=keepalive,
                         record=recorder and recorder.write)
        if writer:
            writer.stamp = {"producer": f"controller:{holder}:{lease.epoch}"}
        n = ctl.start()
        say(f"leading job {job} (epoch {lease.epoch}) on {ep.where}"
            + (f": rebuilt from {n} message(s) already delivered" if n else ""))
        import redis
        away = None
        while not (stop and time.monotonic() >= stop):
            try:
                ctl.step()
                if away is not None:
                    say(f"redis at {ep.where} is back after {time.monotonic() - away:.0f} s")
                    away = None
            except (redis.ConnectionError, redis.TimeoutError) as e:
                ctl.redis_away()
                if away is None:
                    say(f"redis at {ep.where} lost ({e}): trying again every second")
                    away = time.monotonic()
                time.sleep(1.0)
                continue
            for w in (writer, recorder):
                if w:
                    w.flush()
            keepalive()
    except KeyboardInterrupt:
        pass
    finally:
        if ctl is not None:
            try:
                lease.release()
            except Exception:
                pass
        for w in (writer, recorder):
            if w:
                w.close()
    if recorder and recorder.error:
        say(f"the recording stopped: {recorder.error} ({recorder.dropped} input(s) not written)")
    if ctl is not None:
        say(f"stopped: {ctl.plans} plan(s) published, {len(ctl.nodes)} node(s) seen")
    return 0
