"""greyhound-run: relaunch a training job that checkpointed for a restart.

    greyhound-run --control-file /run/job/ctl.json -- \\
        torchrun --nproc-per-node {nproc} train.py --control-file /run/job/ctl.json

Runs the command. When it exits after a checkpoint_restart plan (the
trainer saved its checkpoint, rank 0 wrote `<control>.restart`, the ranks
exited with code 75), it runs the command again, so the trainer resumes from
the checkpoint. `{nproc}` in the command becomes the number of ranks minus
the ones the plan excludes (`--nproc N` gives the starting count), and
GREYHOUND_EXCLUDE / GREYHOUND_RESTARTS are set for the trainer. The restart's
cost (checkpoint written -> the relaunched ranks announce themselves) is
measured and written to `<control>.restart_cost`, where greyhound-trace's
policy reads it instead of its estimate. Any other exit ends the supervisor
with the command's exit code. SIGINT, SIGTERM and SIGHUP are passed to the job.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .control import RESTART_EXIT_CODE, atomic_write_json, read_doc

EPILOG = """\
examples:
  greyhound-run --control-file /tmp/ctl.json --nproc 4 -- \\
      torchrun --nproc-per-node {nproc} scripts/demo_train.py \\
      --control-file /tmp/ctl.json --checkpoint /tmp/ckpt.pt
"""


def say(msg: str) -> None:
    print(f"greyhound-run: {msg}", file=sys.stderr, flush=True)


def read_json(path: Path) -> dict | None:
    try:
        d = read_doc(path)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="greyhound-run", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--control-file", required=True, metavar="PATH",
                   help="the control file the job follows")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks at the first launch, for {nproc} in the command")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="give up after N relaunches (default 3)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the job's command line")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the job's command after --")
    if any("{nproc}" in c for c in cmd) and args.nproc is None:
        p.error("{nproc} in the command needs --nproc N")
    control = Path(args.control_file)
    if not control.parent.is_dir():
        p.error(f"no directory {control.parent} for the control file")
    marker = Path(f"{control}.restart")
    handled = (read_json(marker) or {}).get("seq", 0)
    excluded: list[int] = []
    layer_split: list[int] | None = None
    restarts = 0
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        if child and child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    while True:
        nproc = None if args.nproc is None else args.nproc - len(excluded)
        split = ",".join(map(str, layer_split or []))
        argv_now = [c.replace("{nproc}", str(nproc)).replace("{layer_split}", split)
                    for c in cmd]
        env = dict(os.environ, GREYHOUND_EXCLUDE=",".join(map(str, excluded)),
                   GREYHOUND_LAYER_SPLIT=split, GREYHOUND_RESTARTS=str(restarts))
        say(f"launch {restarts}: {' '.join(argv_now)}")
        try:
            child = subprocess.Popen(argv_now, env=env, start_new_session=True)
        except OSError as e:
            say(f"cannot run {argv_now[0]}: {e}")
            return 127
        code = child.wait()
        req = read_json(marker)
        if not req or req.get("seq", 0) <= handled:
            if code == RESTART_EXIT_CODE:
                say("the job exited for a restart but wrote no restart request; stopping")
            return code
        handled = req["seq"]
        if restarts >= args.max_restarts:
            say(f"restart requested, but --max-restarts {args.max_restarts} reached")
            return code or 1
        restarts += 1
        excluded = sorted(set(excluded) | set(req.get("exclude") or []))
        if req.get("layer_split"):
            layer_split = [int(x) for x in req["layer_split"]]
        say(f"plan {handled}: restarting from {req.get('checkpoint')}"
            + (f" without ranks {excluded}" if excluded else "")
            + (f" with layers per stage {layer_split}" if layer_split else ""))
        saved_ns = int(req.get("saved_ns", time.time_ns()))
        for ack in control.parent.glob(f"{control.name}.ack.*"):
            ack.unlink(missing_ok=True)       # the old job's ranks are gone
        nproc = None if args.nproc is None else args.nproc - len(excluded)
        _measure_restart_in_background(control, saved_ns, nproc)


def _measure_restart_in_background(control: Path, saved_ns: int, ranks: int | None) -> None:
    """Restart cost = checkpoint saved -> every relaunched rank announced.
    Watched from a thread: the supervisor itself waits on the job."""
    import threading

    def watch():
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            acks = [read_json(p) for p in control.parent.glob(f"{control.name}.ack.*")]
            fresh = [a for a in acks if a and a.get("seq") == 0
                     and int(a.get("applied_ns", 0)) > saved_ns]
            if fresh and len(fresh) >= (ranks or 1):
                last = max(int(a["applied_ns"]) for a in fresh)
                atomic_write_json(Path(f"{control}.restart_cost"),
                                  {"restart_s": (last - saved_ns) / 1e9, "saved_ns": saved_ns})
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
