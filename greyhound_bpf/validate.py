"""`greyhound-trace validate`: the command, from its first moment to its
verdict.

A validation loads the host from its first moment (its imports, then the
interpreter check), before it measures. `begin` (the command line calls it
before its own imports) announces it to a tracer on this machine at once
(announce.Busy), not once the imports are done (0.65-0.92 s later on a
2-core host a 4-rank job keeps busy), and runs it at idle priority. The
announcement lasts until the command ends (`end`): one that ended after the
interpreter check left a gap before the validator's own, and a tracer
polling once a second missed a short start-up whole. (Waiting for another
validation's lock adds nothing: that one is announced meanwhile.)

Standard library only at import: the heavy imports are `validate`'s.
"""
from __future__ import annotations

import os
import sys

from . import GreyhoundError
from .diagnosis.announce import Busy
from .diagnosis.cpu import Background, IdleGroup

_announced: Busy | None = None


def begin() -> Background | None:
    """Announced, and (as root) in the background: the caller closes the
    Background it returns, after `end`."""
    global _announced
    _announced = Busy("start").__enter__()
    return Background.start() if os.geteuid() == 0 else None


def end() -> None:
    global _announced
    if _announced is not None:
        _announced.__exit__()
        _announced = None


def validate(args, target: str | None) -> int:
    """Benchmark the devices and links (of a running job's ranks, or
    --world N of this machine's), print the table, write the verdict to
    `target` (a file, "-" for stdout, None); exit 3 when a cause is named,
    1 when nothing could be measured, else 0."""
    from rich.console import Console
    from .diagnosis import host, rules, validator
    from .events import make_event
    from .output.jsonl import JsonLinesWriter
    from .output.validation import render as render_validation
    if bool(args.pids) == (args.world is not None):
        raise GreyhoundError("give either PIDs of a running job or --world N")
    if args.world is not None:
        if args.world < 2:
            raise GreyhoundError("--world must be at least 2 (links need two ends)")
        members = validator.precheck_members(args.world)
        job = f"precheck-{args.world}"
    else:
        if os.geteuid() != 0:
            raise GreyhoundError("validate PID needs root (it enters the ranks' namespaces "
                                 "and cgroups and pauses them): run it with sudo", exit_code=1)
        from .probe.discovery import job_roots, widened_note
        roots, widened = (args.pids, []) if args.only_named else job_roots(args.pids)
        for pid, up in widened:
            print(f"greyhound-trace: {widened_note(pid, up)}", file=sys.stderr)
        members = validator.members_for_job(roots)
        st = host.read_stat(roots[0])
        job = f"{st.comm if st else 'job'}-{roots[0]}"
    err = Console(stderr=True)
    # Checking the interpreter imports what the workers do: load on the
    # host, announced since `begin` (which the command line calls first),
    # at idle priority.
    validator.check_python(args.python, gpus=any(m.device.startswith("cuda") for m in members))
    # The workers' start-up (their imports) on CPU the job leaves idle: in
    # the group our own start-up ran in, which we leave now (the validator's
    # process measures).
    early = Background._running
    if early is not None:
        early.restore()
    idle = None if not args.pids else early.group if early is not None else IdleGroup.create()
    v = validator.Validator(members, pause=not args.no_pause, pause_max_s=args.pause_max,
                           start_timeout_s=args.timeout, python=args.python,
                           progress=lambda msg: err.print(f"greyhound-trace: {msg}",
                                                          highlight=False),
                           idle_group=idle)
    try:
        fields = rules.decide(v.run()).fields()
    finally:
        if idle is not None and (early is None or idle is not early.group):
            idle.remove()                 # (the caller closes the early one)
    if target:
        out = JsonLinesWriter(target)
        out.write(make_event("diagnosis", job, **fields))
        out.close()
    if target != "-":
        Console().print(render_validation(fields))
    if fields["cause"] != "unknown":
        return 3
    return 0 if fields["details"]["devices"] else 1
