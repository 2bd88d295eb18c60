"""The demo's story, run by `sudo scripts/demo` after set-up.

1. start the demo trainer: 4-rank PyTorch DDP on gloo, 32 micro-batches per
   iteration, following a control file;
2. attach `greyhound-trace --mitigate` (the live view on a terminal, or the
   event lines with --headless);
3. after --healthy seconds, give rank 2 half the CPU it was using
   (`greyhound-trace inject compute ... --for SLOW`): detection -> straggler
   named -> rebalance plan -> applied by the trainer;
4. the injection expires: the policy returns to the even split;
5. stop, and print iteration times before / during / mitigated / after and
   the time to each milestone (from the trainer's own log and the events).

Every process and cgroup it made is removed on every exit path, Ctrl-C
included. Exit status 0 when every milestone happened.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mitigation.gone import EVEN_STAYS, TRIAL  # noqa: E402
from harness import (BIN, DEMO_ARGS, DDPJob, cpu_share, median_dur, rank_pids,  # noqa: E402
                     read_jsonl, wait_for)

SLOW_RANK = 2
QUIET_S = 3.0     # > the passive diagnosis' margin after validation (BUSY_AFTER_NS)


def say(msg: str) -> None:
    try:
        print(f"demo: {msg}", file=sys.stderr, flush=True)
    except OSError:
        pass                # the terminal is gone (SIGHUP): clean up all the same


def first(evs, pred):
    return next((e for e in evs if pred(e)), None)


def even_back(evs: list[dict], lift: int) -> dict | None:
    """The event that put the even split back after the lift, or None: the
    even split (a return, or a trial that the policy kept: its verdict
    follows) applied after the lift and not left again (a trial the fault
    outlasted is reverted, and one whose verdict is still to come is not
    back yet); or a trial applied in the fault's last moment that the lift
    ended while it ran, so that the policy kept the even split after the
    lift (its verdict) and nothing was applied again. (A trial can be
    planned in the last moment of the fault and applied after it.)"""
    acts = [e for e in evs if e["kind"] == "action"]
    evens = {e["seq"] for e in acts if e.get("seq") and e.get("plan")
             and len(set(e.get("plan", {}).get("microbatches", {}).values())) == 1}
    trials = {e["seq"] for e in acts if e.get("seq") and e.get("reason", "").startswith(TRIAL)}
    verdicts = [e for e in acts if e.get("strategy") == "none"
                and e.get("reason", "").endswith(EVEN_STAYS)]
    applied = [e for e in evs if e["kind"] == "applied"]
    after = [e for e in applied if e["time_ns"] > lift]
    back = next((e for i, e in enumerate(after) if e["seq"] in evens
                 and all(x["seq"] in evens for x in after[i:])
                 and (e["seq"] not in trials
                      or any(v["time_ns"] >= e["time_ns"] for v in verdicts))), None)
    if back is not None:
        return back
    kept = first(verdicts, lambda e: e["time_ns"] > lift)
    if kept is None:
        return None
    before = [e for e in applied if e["time_ns"] <= kept["time_ns"]]
    if before and before[-1]["seq"] in evens and all(
            e["seq"] in evens for e in applied if e["time_ns"] > kept["time_ns"]):
        return kept
    return None


def verdict(evs: list[dict], inj: int, evidence: str) -> tuple[dict | None, int | None]:
    """The first verdict after the injection that names a cause (a slowdown
    that ramps up over a few iterations can first be reported as a smaller
    step, found unknown), else the first; and its one computation rank."""
    diags = [e for e in evs if e["kind"] == "diagnosis" and e["time_ns"] > inj
             and e["evidence"] == evidence]
    d = first(diags, lambda e: e["cause"] != "unknown") or (diags[0] if diags else None)
    rank = None
    if d and d["cause"] == "computation" and len(d["ranks"]) == 1:
        rank = d["ranks"][0]
    return d, rank


def validated_verdict(evs: list[dict], inj: int) -> tuple[dict | None, int | None]:
    """The fault's validated verdict: a validation's, or the plan's
    confirmation (the plan made on the passive verdict ran as it predicted,
    which only the named rank's slow compute explains: diagnosis.planner,
    so the job was not paused to measure it). The confirmation stands
    unless a validation named a cause before it: a validation of a later
    episode (a busy host after the lift, measured unknown) says nothing of
    this fault's verdict (a CI run's case)."""
    vdiag, vnamed = verdict(evs, inj, "validation")
    confirmed = first(evs, lambda e: e["kind"] == "validation" and e["time_ns"] > inj
                      and e.get("confirmed_by") == "plan")
    if confirmed is not None and (vdiag is None or vnamed is None
                                  or confirmed["time_ns"] < vdiag["time_ns"]):
        vdiag, vnamed = {**confirmed, "evidence": "the plan ran as predicted, no pause"}, None
        if confirmed.get("cause") == "computation" and len(confirmed.get("ranks") or []) == 1:
            vnamed = confirmed["ranks"][0]
    return vdiag, vnamed


def summarize(work: Path, t: dict) -> int:
    from rich.console import Console
    from rich.table import Table
    evs, truth = read_jsonl(work / "events.jsonl"), read_jsonl(t["truth"])
    inj, lift, end = t["inject"], t["lift"], t["end"]
    slow = first(evs, lambda e: e["kind"] == "slowdown" and e.get("scope") == "job"
                 and e["time_ns"] > inj)
    plan = first(evs, lambda e: e["kind"] == "action" and e["time_ns"] > inj
                 and e.get("strategy") == "rebalance_microbatches" and e.get("seq")
                 and e.get("plan"))
    applied = plan and first(evs, lambda e: e["kind"] == "applied" and e["seq"] == plan["seq"])
    even_applied = even_back(evs, lift)
    diag, named = verdict(evs, inj, "passive")
    vdiag, vnamed = validated_verdict(evs, inj)
    by_plan = vdiag is not None and vdiag.get("confirmed_by") == "plan"

    def ms(lo, hi):
        v, n = median_dur(truth, lo, hi)
        return "-" if n == 0 else f"{v:.1f}"
    phases = Table(title="iteration time (trainer's own log: rank 0, start to start, median)",
                   title_justify="left")
    for c in ("phase", "from", "to", "ms"):
        phases.add_column(c, justify="right" if c == "ms" else "left")
    start = t["attached"]
    rel = lambda ns: f"{(ns - start) / 1e9:+.0f} s"  # noqa: E731
    phases.add_row("before", "attach", "slowdown", ms(start + int(3e9), inj))
    hi = applied["time_ns"] if applied else lift
    phases.add_row("slowed, before the plan", rel(inj), rel(hi), ms(inj + int(3e8), hi))
    if applied:
        phases.add_row("slowed, rebalanced", rel(applied["time_ns"]), rel(lift),
                       ms(applied["time_ns"] + int(1e9), lift))
    lo = even_applied["time_ns"] if even_applied else lift + int(5e9)
    phases.add_row("after the slowdown", rel(lo), rel(end), ms(lo + int(1e9), end))

    miles = Table(title="milestones (after the injection)", title_justify="left")
    miles.add_column("milestone")
    miles.add_column("after", justify="right")
    miles.add_column("evidence")
    s = lambda e, base: "-" if not e else f"{(e['time_ns'] - base) / 1e9:.1f} s"  # noqa: E731
    miles.add_row("slowdown detected", s(slow, inj),
                  "" if not slow else f"x{slow['ratio']:.2f}, p={slow['probability']:.2f}")
    for d, who in ((diag, named), (vdiag, vnamed)):
        paused = (f", job paused {d['details']['paused_s']:.1f} s"
                  if d and "paused_s" in d.get("details", {}) else "")
        label = "diagnosis" if d is diag else (
            "confirmed by the plan" if by_plan else "validated diagnosis")
        miles.add_row(label, s(d, inj),
                      "" if not d else
                      f"{d['cause']}" + ("" if who is None else f", rank {who}"
                                         f"{' (correct)' if who == SLOW_RANK else ' (WRONG)'}")
                      + f", {d['evidence']}{paused}")
    miles.add_row("rebalance planned", s(plan, inj), "" if not plan else "micro-batches " + "/".join(
        str(v) for _, v in sorted(plan["plan"]["microbatches"].items(), key=lambda kv: int(kv[0]))))
    miles.add_row("plan applied by every rank", s(applied, inj),
                  "" if not applied else f"seq {applied['seq']}")
    miles.add_row("slowdown lifted", f"{(lift - inj) / 1e9:.1f} s", "")
    miles.add_row("back to the even split", s(even_applied, inj),
                  "" if not even_applied else f"{s(even_applied, lift)} after the lift")
    con = Console()
    con.print(phases)
    con.print(miles)
    # The validated (or confirmed) verdict must name rank 2; the passive one names it too,
    # or says `unknown` when a busy moment of this shared host blurs the
    # timing (never a wrong rank or cause).
    passive_ok = bool(diag) and (named == SLOW_RANK or diag["cause"] == "unknown")
    ok = bool(slow and plan and applied and even_applied and passive_ok
              and vnamed == SLOW_RANK)
    if not diag or diag["cause"] == "unknown":
        passive = diag["cause"] if diag else "no"
    else:
        passive = f"{diag['cause']} rank(s) {diag['ranks']}{'' if passive_ok else ' (WRONG)'}"
    print(f"demo: {'story complete' if ok else 'story INCOMPLETE'}: detection "
          f"{'yes' if slow else 'no'}, diagnosis {passive}"
          f", validated {'rank ' + str(vnamed) if vnamed is not None else 'no'}"
          f"{' (confirmed by the plan)' if by_plan else ''}"
          f", rebalance {'yes' if applied else 'no'}, recovery {'yes' if even_applied else 'no'}"
          f" (events and logs in {work})", flush=True)
    # The post-mortem page: what `greyhound-trace report` writes.
    from greyhound_bpf.output.report import render
    (work / "report.html").write_text(render(evs, source="events.jsonl"))
    print(f"demo: report: {work / 'report.html'} (open it in a browser)", flush=True)
    return 0 if ok else 1


def quiet_before_injecting(headless: bool, longest_s: float = 30.0) -> None:
    """Wait until no validation has run on this machine for QUIET_S: the
    tracer validates a healthy job's noise slowdowns too, and a fault injected
    while that runs would be judged on iterations our own benchmark slowed."""
    from greyhound_bpf.diagnosis.host import busy_since
    deadline, quiet_since = time.monotonic() + longest_s, time.monotonic()
    told = False
    while time.monotonic() < deadline:
        if busy_since() is not None:
            quiet_since = time.monotonic()
            if headless and not told:
                say("waiting for the validation in progress to finish before the slowdown")
                told = True
        elif time.monotonic() - quiet_since >= QUIET_S:
            return
        time.sleep(0.2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--headless", action="store_true",
                   help="no live view: the tool's event lines, then the summary (for CI)")
    p.add_argument("--healthy", type=float, default=30.0, help="seconds before the slowdown")
    p.add_argument("--slow", type=float, default=45.0, help="seconds the slowdown lasts")
    # A trial return to even that the lift cuts in half can read the fault
    # still there; the next trial follows 40 s later (the doubling).
    p.add_argument("--after", type=float, default=50.0,
                   help="longest wait for the even split after the slowdown")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="greyhound-demo."))
    log = open(work / "inject.log", "w")
    job = tracer = inject = None
    t: dict[str, int] = {}
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt
    # SIGINT too, explicitly: a shell that starts us in the background
    # without job control leaves SIGINT ignored, and Ctrl-C must still clean up.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)    # the terminal was closed
    try:
        say(f"starting a 4-rank gloo DDP job (logs in {work})")
        job = DDPJob(work, 4, *DEMO_ARGS, "--control-file", str(work / "ctl.json"), name="job")
        t["truth"] = job.truth
        pids = wait_for(lambda: len(rank_pids(job.pid)) == 4 and rank_pids(job.pid), 120)
        if not pids or not wait_for(lambda: len(job.truth_records()) >= 8, 120, interval=0.2):
            say(f"the job did not start; see {work}")
            return 1
        cmd = [str(BIN / "greyhound-trace"), "attach", str(job.pid), "--mitigate",
               "--control-file", str(work / "ctl.json"), "-o", str(work / "events.jsonl")]
        if args.headless:
            cmd += ["--no-tui", "-q"]
        say(f"sudo {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}")
        tracer = subprocess.Popen(cmd)
        if not wait_for(lambda: any(e["kind"] == "iteration"
                                    for e in read_jsonl(work / "events.jsonl")), 120,
                        interval=0.2):
            say("greyhound-trace saw no iteration")
            return 1
        t["attached"] = time.time_ns()
        victim = pids[SLOW_RANK]
        share = cpu_share(victim, args.healthy)
        quiet_before_injecting(args.headless)
        quota = max(0.01, share / 2)
        inj_cmd = [str(BIN / "greyhound-trace"), "inject", "compute", "--pid", str(victim),
                   "--quota", f"{quota:.3f}", "--for", str(args.slow)]
        if args.headless:
            say(f"slowing rank {SLOW_RANK} down: {' '.join(inj_cmd[1:])}")
        t["inject"] = time.time_ns()
        inject = subprocess.Popen(inj_cmd, stdout=None if args.headless else log,
                                  stderr=subprocess.STDOUT if not args.headless else None)
        inject.wait()
        t["lift"] = time.time_ns()
        lift = t["lift"]
        wait_for(lambda: even_back(read_jsonl(work / "events.jsonl"), lift), args.after,
                 interval=0.5)
        time.sleep(5)
        t["end"] = time.time_ns()
    except KeyboardInterrupt:
        interrupted.append(signal.SIGINT)
        say("interrupted: cleaning up")
    finally:
        if inject and inject.poll() is None:
            inject.terminate()                  # it undoes its own quota
            inject.wait()
        if tracer and tracer.poll() is None:
            tracer.send_signal(signal.SIGINT)   # closes the view, prints the tool's summary
            try:
                tracer.wait(30)
            except subprocess.TimeoutExpired:
                tracer.kill()
        if job:
            job.close()
        log.close()
        say("cleaned up: no job process, no cgroup left")
    if interrupted or "end" not in t:
        return 130 if interrupted else 1
    return summarize(work, t)


if __name__ == "__main__":
    sys.exit(main())
