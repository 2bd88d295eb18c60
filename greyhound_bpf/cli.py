"""greyhound-trace: the command line."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from . import GreyhoundError, __version__
from . import argtypes as T
from .cluster import cli as cluster_cli
# Standard library only: `attach` enters the background before the heavy
# imports (numpy, Numba, BCC), which cost a saturated job CPU otherwise.
from . import validate as validate_command
from .diagnosis.cpu import Background, IdleGroup

EPILOG_ATTACH = """\
examples:
  sudo greyhound-trace attach 4242              # torchrun, or a rank: its job
  sudo greyhound-trace attach 4242 --only-named # that rank alone
  sudo greyhound-trace attach 4242 -T -i 5      # timestamped, every 5 s
  sudo greyhound-trace attach -p 4242 -p 4243   # ranks directly (as bcc tools)
  sudo greyhound-trace attach 4242 -o ev.jsonl --calls --duration 60
  sudo greyhound-trace attach 4242 --record run.rec.gz   # replay it later
  sudo greyhound-trace attach 4242 -j | jq 'select(.kind=="lost")'
  sudo greyhound-trace attach --wait $(pgrep -f train.sh)  # ranks start later
  sudo greyhound-trace attach 4242 --control-file /run/ctl.json     # advise
  sudo greyhound-trace attach 4242 --control-file /run/ctl.json --mitigate
  sudo greyhound-trace attach 4242 --metrics 9400   # Prometheus, loopback
  sudo greyhound-trace attach 4242 --start-cpu 0.1  # gentler, probes later

exit status: 0 when the targets exit or on Ctrl-C/SIGTERM/--duration;
1 for an environment problem (not root, BCC, kernel); 2 for bad input.
"""

EPILOG_REPLAY = """\
examples:
  sudo greyhound-trace attach 4242 --record run.rec.gz --duration 300
  greyhound-trace replay run.rec.gz | jq 'select(.kind=="diagnosis")'
  greyhound-trace replay run.rec.gz --no-iterations --threshold 0.2 -o ev.jsonl
"""

EPILOG_REPORT = """\
examples:
  sudo greyhound-trace attach 4242 -o events.jsonl --duration 600
  greyhound-trace report events.jsonl -o report.html
  greyhound-trace report run.rec.gz -o report.html     # a recording, replayed first
"""

INJECT_DEFAULT_S = 600.0

EPILOG_INJECT = """\
examples:
  sudo greyhound-trace inject compute --pid 4242 --quota 0.5 --for 60
  sudo greyhound-trace inject compute --pid 4242 --quota 0.3 --period-ms 100   # as k8s throttles
  sudo greyhound-trace inject link --dev eth1 --rate 400mbit --for 0   # until Ctrl-C
  sudo greyhound-trace inject gpu-clock --gpu 3 --mhz 900 --for 120
  sudo greyhound-trace inject --undo-all       # clean up after a killed inject

An injection lasts while the command runs: it is undone when --for expires
(10 minutes unless said), on Ctrl-C, SIGTERM and SIGHUP. Only SIGKILL can
leave one behind; --undo-all removes it (a GPU clock included: what each
injection changed is kept in /run/greyhound/inject).
"""

EPILOG_VALIDATE = """\
examples:
  greyhound-trace validate --world 4           # pre-check: 4 devices, ring links
  sudo greyhound-trace validate 4242           # the ranks of a running job
  sudo greyhound-trace validate 4242 -o v.jsonl --no-pause

With PIDs, one worker per rank runs where the rank runs (its network
namespace, cgroups and CPU affinity); the job is paused (SIGSTOP) only while
the benchmarks measure, at most --pause-max seconds, and a watchdog resumes
it even if this command is killed. Exit 0 when nothing is slow, 3 when a
device or link is, 1 when nothing could be measured.
"""

EPILOG_CHECK = """\
examples:
  greyhound-trace check                # can this machine trace?
  sudo greyhound-trace check --pid 4242   # ...and what does PID 4242 map?
"""


def build_parser() -> argparse.ArgumentParser:
    from .diagnosis.host import PAUSE_MAX_S
    from .diagnosis.planner import PAUSE_BUDGET
    from .engine.detector import MIN_PROBABILITY, SLOWDOWN_THRESHOLD
    p = argparse.ArgumentParser(
        prog="greyhound-trace",
        description="Catch fail-slow GPUs and links in a running training job with eBPF.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("attach", help="trace a running job (needs root)",
                       description="Attach uprobes to the NCCL, CUDA runtime and gloo calls\n"
                                   "of a running job and its ranks, without restarting it.",
                       epilog=EPILOG_ATTACH, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("pids", metavar="PID", type=T.pid, nargs="*",
                   help="a rank, or a launcher (torchrun, mpirun, a script): its ranks are found")
    a.add_argument("-p", "--pid", dest="more_pids", type=T.pid, action="append", default=[],
                   metavar="PID", help="a PID too (repeatable; bcc tools' spelling)")
    a.add_argument("--only-named", action="store_true",
                   help="trace only the PIDs named (and their descendants): by default one "
                        "rank's PID under a launcher (torchrun, mpirun, mp.spawn's script) "
                        "traces its whole job, every rank under that launcher")
    a.add_argument("-i", "--interval", type=T.positive, default=1.0, metavar="S",
                   help="seconds between text summaries (default 1)")
    a.add_argument("-n", "--count", type=int, metavar="N", help="stop after N summaries")
    _output_args(a, "events as JSON lines on stdout (the text summary then goes to stderr)",
                 "write the JSON-lines events to FILE (the view or text stays on the terminal)")
    a.add_argument("--calls", action="store_true",
                   help="include one `call` event per probed call in the JSON stream")
    a.add_argument("--record", metavar="FILE",
                   help="record every input of the analysis to FILE (.gz: compressed), for "
                        "`greyhound-trace replay FILE`")
    a.add_argument("-d", "--duration", type=T.positive, metavar="S", help="stop after S seconds")
    a.add_argument("--wait", action="store_true",
                   help="wait for the targets to load a probed library instead of failing")
    a.add_argument("--job", help="job name in events (default: the first PID's name-pid)")
    a.add_argument("--ringbuf-pages", type=int, default=None, metavar="N",
                   help="BPF ring buffer size in 4 KiB pages, a power of two (default 256)")
    a.add_argument("--count-launches", action="store_true",
                   help="count cudaLaunchKernel per process, in the kernel")
    a.add_argument("-q", "--quiet", action="store_true", help="no interval summaries")
    a.add_argument("-T", "--timestamp", action="store_true",
                   help="print the wall-clock time (HH:MM:SS) on every text line")
    a.add_argument("--no-tui", action="store_true",
                   help="plain text lines even on a terminal (the live view is the default "
                        "when stdout is a terminal and -j is not given)")
    a.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)

    a.add_argument("--threshold", type=T.positive, default=SLOWDOWN_THRESHOLD, metavar="F",
                   help="report a slowdown when iterations get this much slower "
                        f"(default {SLOWDOWN_THRESHOLD:g})")
    a.add_argument("--min-probability", type=T.probability, default=MIN_PROBABILITY, metavar="P",
                   help=f"change probability a slowdown needs (default {MIN_PROBABILITY:g})")

    a.add_argument("--metrics", type=T.listen, metavar="[ADDR:]PORT",
                   help="serve Prometheus metrics on ADDR:PORT (default address loopback; "
                        "PORT 0: any free port), as the exporters spell it; an address "
                        "other than loopback needs TLS (--metrics-cert/--metrics-key) or "
                        "--metrics-plaintext")
    a.add_argument("--metrics-cert", metavar="FILE",
                   help="serve metrics over TLS with this certificate (PEM)")
    a.add_argument("--metrics-key", metavar="FILE", help="its private key (PEM)")
    a.add_argument("--metrics-client-ca", metavar="FILE",
                   help="with TLS: scrapers must present a certificate signed by this CA")
    a.add_argument("--metrics-plaintext", action="store_true",
                   help="serve plain HTTP on a non-loopback address (anyone who reaches "
                        "it reads the job's ranks, pids and verdicts)")
    # The spelling before --metrics, kept for one release.
    a.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="deprecated: --metrics PORT")
    a.add_argument("--metrics-addr", metavar="ADDR", help="deprecated: --metrics ADDR:PORT")

    a.add_argument("--no-validate", action="store_true",
                   help="after a job slowdown, do not benchmark the devices and links "
                        "(see `validate`; the job is paused at most --pause-max seconds)")
    a.add_argument("--pause-max", type=T.positive, default=PAUSE_MAX_S, metavar="S",
                   help=f"longest validation may pause the job (default {PAUSE_MAX_S:g})")
    a.add_argument("--start-cpu", type=T.probability, metavar="CPUS",
                   help="at most this much of one CPU for start-up (before the probes "
                        "are in; default: no cap, idle priority only): a job that leaves "
                        "CPU idle loses less in any 2 s, the probes come in later")
    a.add_argument("--pause-budget", type=T.fraction, metavar="F",
                   help="most of any 10 minutes validation may keep the job paused "
                        f"(default {PAUSE_BUDGET:g}: 1%%)")
    a.add_argument("--always-validate", action="store_true",
                   help="with --mitigate, validate a verdict even when the plan made on it "
                        "ran as predicted (by default that confirms it: no pause)")

    m = a.add_argument_group("mitigation (advise only unless --mitigate)")
    m.add_argument("--control-file", metavar="PATH",
                   help="the control file the training script follows (mitigation.control); "
                        "its acks tell the tool what each rank runs")
    m.add_argument("--mitigate", action="store_true",
                   help="write plans to --control-file (default: only report them as "
                        "`action` events)")
    m.add_argument("--microbatches", type=int, metavar="M",
                   help="global micro-batches per iteration, when the trainer does not "
                        "announce it")
    m.add_argument("--restart-cost", type=T.positive, default=60.0, metavar="S",
                   help="checkpoint-restart cost assumed until one is observed (default 60)")
    cluster_cli.add_agent_args(a)

    r = sub.add_parser("replay", help="run the analysis over a recorded run",
                       description="Feed a recording made with `attach --record FILE` to the\n"
                                   "analysis: the live run's events again, diagnoses and plans\n"
                                   "included (an `attach -o FILE --calls` stream gives the\n"
                                   "engine's events). The same file always gives the same events.",
                       epilog=EPILOG_REPLAY, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("file", metavar="FILE", help="a recording (attach --record), or an event "
                                                 "stream with call events")
    _output_args(r, "JSON lines on stdout (the default)", "write the events to FILE")
    r.add_argument("--no-iterations", action="store_true",
                   help="leave out `iteration` events (keep pattern/slowdown/recovery)")
    r.add_argument("--threshold", type=T.positive, metavar="F",
                   help="override the recorded slowdown threshold")
    r.add_argument("--min-probability", type=T.probability, metavar="P",
                   help="override the recorded change probability")

    rp = sub.add_parser("report", help="a post-mortem HTML page with plots",
                        description="One self-contained HTML file (inline SVG plots, no\n"
                                    "scripts) from a run's events: iteration time per rank with\n"
                                    "slowdowns, diagnoses, pauses and plans marked; compute and\n"
                                    "blocked time in the worst episode; validation measurements\n"
                                    "against their thresholds; plans and the time lost and\n"
                                    "recovered; a table of episodes.",
                        epilog=EPILOG_REPORT, formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("file", metavar="FILE", help="events (attach -o FILE) or a recording "
                                                  "(attach --record FILE)")
    rp.add_argument("-o", "--output", metavar="FILE", required=True,
                    help="the HTML file to write")

    inj = sub.add_parser("inject", help="slow a rank, link or GPU down on purpose (needs root)",
                         description="Inject a fail-slow for real, to check that your setup\n"
                                     "detects and mitigates it before you rely on it.",
                         epilog=EPILOG_INJECT,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    inj.add_argument("--undo-all", action="store_true",
                     help="undo every injection left behind (cgroups, qdiscs, GPU clocks)")
    isub = inj.add_subparsers(dest="fault", metavar="FAULT")
    ic = isub.add_parser("compute", help="lower a process's CPU quota (cgroup v1 or v2, "
                                         "found at run time)")
    ic.add_argument("--pid", type=T.pid, required=True, help="the process (a rank)")
    ic.add_argument("--quota", type=T.positive, required=True, metavar="CPUS",
                    help="CPUs it may use, e.g. 0.5")
    ic.add_argument("--period-ms", type=T.positive, metavar="MS",
                    help="the CFS period the quota is enforced over (default 2: an even "
                         "slowdown, like a lowered GPU clock; 100: the kernel's default, as "
                         "Docker's --cpus and Kubernetes' CPU limits throttle: bursts and "
                         "stalls)")
    il = isub.add_parser("link", help="rate-limit a network interface (tc tbf)")
    il.add_argument("--dev", required=True, metavar="IFACE", help="the interface, e.g. eth1")
    il.add_argument("--rate", required=True, metavar="RATE", help="e.g. 400mbit, 1gbit")
    ig = isub.add_parser("gpu-clock", help="lock a GPU's clock (NVML)")
    ig.add_argument("--gpu", type=int, required=True, metavar="N", help="GPU index")
    ig.add_argument("--mhz", type=int, required=True, metavar="F", help="clock in MHz")
    for q in (ic, il, ig):
        q.add_argument("--for", dest="seconds", type=T.nonnegative, default=INJECT_DEFAULT_S,
                       metavar="S", help=f"undo after S seconds (default {INJECT_DEFAULT_S:g}, "
                       "so a forgotten one ends; 0: only on Ctrl-C or SIGTERM)")

    v = sub.add_parser("validate", help="benchmark each device and link, name the slow one",
                       description="GEMM per device and p2p ping-pong per ring edge (concurrent\n"
                                   "disjoint rounds), then a robust outlier test against the\n"
                                   "median. Before a job (--world N) or on a running one (PID).",
                       epilog=EPILOG_VALIDATE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("pids", metavar="PID", type=T.pid, nargs="*",
                   help="a rank or launcher of a running job (needs root): a rank's PID "
                        "under a launcher measures its whole job")
    v.add_argument("--only-named", action="store_true",
                   help="measure only the ranks under the PIDs named")
    v.add_argument("--world", type=int, metavar="N",
                   help="pre-check N devices on this machine before a job starts")
    _output_args(v, "the `diagnosis` event as a JSON line on stdout, instead of the table",
                 "also write the `diagnosis` event to FILE")
    v.add_argument("--no-pause", action="store_true",
                   help="measure while the job runs (noisier; nothing is paused)")
    v.add_argument("--pause-max", type=T.positive, default=PAUSE_MAX_S, metavar="S",
                   help=f"longest the job may be paused (default {PAUSE_MAX_S:g})")
    v.add_argument("--timeout", type=T.positive, default=60.0, metavar="S",
                   help="longest wait for the workers to start (default 60)")
    v.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="interpreter for the workers, with PyTorch (default: this one; "
                        "e.g. the job's own)")

    c = sub.add_parser("check", help="can this machine trace? what does PID map?",
                       description="Check every requirement of `attach` and print the fix\n"
                                   "for each one that fails. Exit 0 when tracing can work.",
                       epilog=EPILOG_CHECK, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--pid", type=T.pid, help="also report which probe libraries PID maps")
    c.add_argument("--no-load", action="store_true", help="skip compiling the BPF program")
    cluster_cli.add_controller_parser(sub, _output_args, T.positive)
    return p


def _output_args(p, json_help: str, output_help: str) -> None:
    p.add_argument("-j", "--json", action="store_true", help=json_help)
    p.add_argument("-o", "--output", metavar="FILE", help=output_help)


def _json_target(args) -> str | None:
    """Where JSON lines go: -o FILE, else stdout with -j, else nowhere."""
    return args.output or ("-" if args.json else None)


def cmd_attach(args) -> int:
    from .attach import AttachOptions, AttachSession
    from .diagnosis.planner import PAUSE_BUDGET
    from .probe.tracer import DEFAULT_RINGBUF_PAGES
    if args.ebpf:
        from .probe.tracer import Tracer
        from .probe.catalog import load_catalog
        t = Tracer(load_catalog(), args.ringbuf_pages or DEFAULT_RINGBUF_PAGES)
        print(f"// cflags: {' '.join(t.cflags())}")
        print(open(t.source_path()).read())
        return 0
    pids = list(dict.fromkeys(args.pids + args.more_pids))
    if not pids:
        raise GreyhoundError("give the PID of a rank or of its launcher (PID or -p PID)")
    agent = cluster_cli.agent_setup(args, pids)
    if agent is not None:
        # The controller validates and plans for the whole job (agent_setup
        # refuses its options); the node's control file gets its plans
        # through the agent.
        args.job, args.no_validate, args.mitigate = agent.job, True, False
    out = _json_target(args)
    addr, port = args.metrics or (args.metrics_addr or "127.0.0.1", args.metrics_port)
    if args.metrics_addr and args.metrics_port is None and not args.metrics:
        raise GreyhoundError("--metrics-addr needs a port: --metrics ADDR:PORT")
    from .output.metrics import tls_options
    tls = tls_options(args.metrics_cert, args.metrics_key, args.metrics_client_ca,
                      addr, port, args.metrics_plaintext)
    opts = AttachOptions(
        pids=pids, json_path=out, record_path=args.record, calls=args.calls,
        duration=args.duration,
        interval=None if args.quiet else args.interval, count=args.count, wait=args.wait,
        only_named=args.only_named,
        ringbuf_pages=args.ringbuf_pages or DEFAULT_RINGBUF_PAGES,
        count_launches=args.count_launches, job=args.job, threshold=args.threshold,
        min_probability=args.min_probability, control_file=args.control_file,
        mitigate=args.mitigate, microbatches=args.microbatches,
        restart_estimate_s=args.restart_cost, metrics_port=port, metrics_addr=addr,
        metrics_tls=tls,
        timestamps=args.timestamp, validate=not args.no_validate,
        pause_max_s=args.pause_max, cluster=agent,
        pause_budget=PAUSE_BUDGET if args.pause_budget is None else args.pause_budget,
        always_validate=args.always_validate,
        tui=sys.stdout.isatty() and out != "-" and not args.no_tui and not args.quiet)
    if args.microbatches is not None and args.microbatches < 1:
        raise GreyhoundError("--microbatches must be at least 1")
    return AttachSession(opts).run()


def cmd_replay(args) -> int:
    from .output.jsonl import JsonLinesWriter
    from .replay import replay
    overrides = {k: v for k, v in (("threshold", args.threshold),
                                   ("min_probability", args.min_probability)) if v is not None}
    events = replay(args.file, **overrides)
    out = JsonLinesWriter(args.output or "-")
    for ev in events:
        if args.no_iterations and ev["kind"] == "iteration":
            continue
        out.write(ev)
    out.close()
    return 0


def cmd_report(args) -> int:
    import os
    from .output.report import read_events, render
    from .replay import replay
    events = read_events(args.file, replay)
    try:
        page = render(events, source=os.path.basename(args.file))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # Envelopes fine, but an event lacks what its kind has (hand-edited?).
        raise GreyhoundError(f"{args.file}: an event lacks a field of its kind "
                             f"({type(e).__name__}: {e})") from None
    tmp = f"{args.output}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(page)
        os.replace(tmp, args.output)       # never half a page
    except OSError as e:
        raise GreyhoundError(f"cannot write {args.output}: {e.strerror}") from None
    print(f"greyhound-trace: wrote {args.output}")
    return 0


def cmd_inject(args) -> int:
    import os
    import signal
    import time
    from . import inject
    if os.geteuid() != 0:
        raise GreyhoundError("inject needs root (cgroups, tc, NVML clocks): run it with sudo",
                             exit_code=1)
    if args.undo_all:
        done = inject.undo_all()
        for what in done:
            print(f"greyhound-trace: undid {what}")
        if not done:
            print("greyhound-trace: nothing to undo")
        return 0
    if args.fault is None:
        raise GreyhoundError("name a fault (compute, link, gpu-clock) or --undo-all")
    if args.fault == "compute":
        fault = inject.CpuQuota(args.pid, args.quota, period_ms=args.period_ms)
        what = f"pid {args.pid} limited to {args.quota:g} CPU" + \
            (f" per {args.period_ms:g} ms period" if args.period_ms else "")
    elif args.fault == "link":
        fault, what = inject.LinkRate(args.dev, args.rate), f"{args.dev} limited to {args.rate}"
    else:
        fault, what = inject.GpuClock(args.gpu, args.mhz), f"GPU {args.gpu} locked at " \
                                                            f"{args.mhz} MHz"
    stop = []
    old = {sig: signal.signal(sig, lambda s, f: stop.append(s))
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    deadline = time.monotonic() + args.seconds if args.seconds else None
    fault.apply()          # a refused one undoes nothing (not someone else's lock)
    try:
        until = f"for {args.seconds:g} s" if deadline else "until Ctrl-C"
        print(f"greyhound-trace: {what} {until}", flush=True)
        while not stop and (deadline is None or time.monotonic() < deadline):
            if args.fault == "compute" and not os.path.exists(f"/proc/{args.pid}"):
                print(f"greyhound-trace: pid {args.pid} exited", flush=True)
                break
            time.sleep(0.1)
    finally:
        fault.undo()
        for sig, h in old.items():
            signal.signal(sig, h)
    print(f"greyhound-trace: undone ({what.split(' limited')[0].split(' locked')[0]} "
          "restored)", flush=True)
    return 0


def cmd_validate(args) -> int:
    return validate_command.validate(args, _json_target(args))


def cmd_check(args) -> int:
    from rich.console import Console
    from .inject import cpu_controller
    from .probe.check import OK, WARN, Row, exit_code, render, run_checks
    rows = run_checks(pid=args.pid, try_load=not args.no_load)
    try:   # for `inject compute` and the demo only: tracing does not need it
        rows.append(Row("cgroup cpu controller", OK, cpu_controller().describe()))
    except GreyhoundError as e:
        rows.append(Row("cgroup cpu controller", WARN, f"{e} (`inject compute` and the demo "
                        "need it; tracing does not)"))
    if os.geteuid() == 0:
        ok, detail = IdleGroup.check()
        rows.append(Row("idle CPU group", OK if ok else WARN, detail))
    Console().print(render(rows))
    code = exit_code(rows)
    print("tracing can work" if code == 0 else "tracing cannot work until the FAIL lines are fixed")
    return code


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    early = None
    helping = bool({"-h", "--help"} & set(words))
    validating = words[:1] == ["validate"] and not helping
    if words[:1] == ["attach"] and os.geteuid() == 0 and not helping and "--ebpf" not in words:
        # From the first moment: everything before the probes are in is
        # start-up, the Python imports included (diagnosis/cpu.py).
        early = Background.start(cpu_cap=_early_start_cpu(words))
    elif validating:
        early = validate_command.begin()      # so is a validation's
    try:
        return _main(argv)
    finally:
        if validating:
            validate_command.end()
        if early is not None:
            early.close()


def _early_start_cpu(words: list[str]) -> float | None:
    """--start-cpu's value before argparse runs (which reports a bad one)."""
    for i, w in enumerate(words):
        v = w.partition("=")[2] if w.startswith("--start-cpu=") else \
            words[i + 1] if w == "--start-cpu" and i + 1 < len(words) else None
        if v is not None:
            try:
                return T.probability(v)
            except argparse.ArgumentTypeError:
                return None
    return None


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # SIGTERM and a closed terminal (SIGHUP) end a command the way Ctrl-C
    # does, through its cleanup (validation workers, a paused job, an
    # injection); attach and inject install their own handlers. SIGINT too,
    # explicitly: a command started in the background of a script (`... &`
    # in a non-interactive shell) inherits SIGINT ignored, and Python then
    # leaves it so: `kill -INT` on a controller did nothing.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        return {"attach": cmd_attach, "replay": cmd_replay, "report": cmd_report,
                "check": cmd_check,
                "controller": lambda a: cluster_cli.cmd_controller(a, _json_target),
                "inject": cmd_inject, "validate": cmd_validate}[args.command](args)
    except GreyhoundError as e:
        print(f"greyhound-trace: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
