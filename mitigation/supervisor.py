"""greyhound-run: relaunch a training job that checkpointed for a restart.

    greyhound-run --control-file /run/job/ctl.json -- \\
        torchrun --nproc-per-node {nproc} train.py --control-file /run/job/ctl.json

Runs the command. When it exits after a checkpoint_restart plan (the
trainer saved its checkpoint, rank 0 wrote `<control>.restart`, the ranks
exited with code 75), it runs the command again, so the trainer resumes from
the checkpoint. Exclusions are per launch: the plan's `exclude` names ranks
of the launch that ended, so `{nproc}` becomes that launch's count minus
them (`--nproc N` gives the first count), and GREYHOUND_EXCLUDE lists them
for the trainer (which maps the data streams of the ranks kept onto the new,
contiguous ranks). Where the plan says where those ranks ran (`where`: host,
CPUs, GPU, as the trainer announced them), the relaunch avoids it on this
host: the job's CPU affinity leaves those CPUs out, and CUDA_VISIBLE_DEVICES
leaves those GPUs out. Other hosts are for the scheduler: `--on-exclude CMD`
runs CMD with GREYHOUND_EXCLUDE_HOSTS (e.g. `scontrol update
nodename=$GREYHOUND_EXCLUDE_HOSTS state=drain reason=fail-slow` for Slurm,
`kubectl taint nodes $GREYHOUND_EXCLUDE_HOSTS greyhound=slow:NoSchedule`).
Every launch's exclusions are appended to `<control>.exclusions` (JSON
lines) and said. The restart's cost (checkpoint written -> the relaunched
ranks announce themselves) is measured and written to
`<control>.restart_cost`, where greyhound-trace's policy reads it instead
of its estimate. Any other exit ends the supervisor with the command's exit
code. SIGINT, SIGTERM and SIGHUP are passed to the job.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .control import RESTART_EXIT_CODE, atomic_write_json, read_doc


class Avoid:
    """The devices of this host that relaunches leave out, accumulated over
    launches (a device's identity holds across launches; a rank number does
    not)."""

    def __init__(self, host: str | None = None):
        self.host = host or socket.gethostname()
        self.cpus: set[int] = set()
        self.gpus: set[str] = set()
        self.other_hosts: set[str] = set()

    def add(self, where: list) -> None:
        for w in where or []:
            if not isinstance(w, dict):
                continue
            if w.get("host") not in (None, self.host):
                self.other_hosts.add(str(w["host"]))
                continue
            self.cpus |= {int(c) for c in w.get("cpus") or [] if isinstance(c, int)}
            if isinstance(w.get("gpu"), str):
                self.gpus.add(w["gpu"])

    def affinity(self, allowed: set[int]) -> set[int] | None:
        """CPUs for the relaunched job, or None to leave it as it is (nothing
        to avoid, or avoiding would leave no CPU)."""
        keep = allowed - self.cpus
        return keep if self.cpus & allowed and keep else None

    def visible_gpus(self, env: dict) -> str | None:
        """CUDA_VISIBLE_DEVICES without the avoided GPUs (by UUID), or None."""
        if not self.gpus:
            return None
        listed = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        if not listed:
            listed = _gpu_uuids()
        keep = [g for g in listed if g not in self.gpus]
        return ",".join(keep) if keep != listed else None


def _gpu_uuids() -> list[str]:
    """This machine's whole GPUs by UUID (diagnosis.gpus reads NVML; none
    without a driver)."""
    from greyhound_bpf.diagnosis.gpus import nvml_gpus
    return [g.uuid for g in nvml_gpus() if g.uuid.startswith("GPU-")]


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
    p.add_argument("--on-exclude", metavar="CMD",
                   help="run CMD (a shell command) before a relaunch that leaves out ranks "
                        "of other hosts, with GREYHOUND_EXCLUDE_HOSTS set: the scheduler's "
                        "hook (Slurm drain, Kubernetes taint)")
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
    excluded: list[int] = []              # ranks the last launch left out
    avoid = Avoid()
    allowed = set(os.sched_getaffinity(0))
    nproc = args.nproc
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
        split = ",".join(map(str, layer_split or []))
        argv_now = [c.replace("{nproc}", str(nproc)).replace("{layer_split}", split)
                    for c in cmd]
        env = dict(os.environ, GREYHOUND_EXCLUDE=",".join(map(str, excluded)),
                   GREYHOUND_LAYER_SPLIT=split, GREYHOUND_RESTARTS=str(restarts))
        cpus = avoid.affinity(allowed)
        gpus = avoid.visible_gpus(env)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        say(f"launch {restarts}: {' '.join(argv_now)}"
            + (f" (CPUs {sorted(cpus)})" if cpus else "")
            + (f" (CUDA_VISIBLE_DEVICES={gpus})" if gpus is not None else ""))
        try:
            child = subprocess.Popen(argv_now, env=env, start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                                     if cpus else None)
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
        excluded = sorted({int(r) for r in req.get("exclude") or []})
        if nproc is not None:
            nproc -= len(excluded)
            if nproc < 1:
                say(f"plan {handled} leaves no rank to run; stopping")
                return code or 1
        hosts_before = set(avoid.other_hosts)
        avoid.add(req.get("where") or [])
        new_hosts = sorted(avoid.other_hosts - hosts_before)
        if new_hosts and args.on_exclude:
            say(f"running the exclusion hook for {', '.join(new_hosts)}")
            subprocess.run(args.on_exclude, shell=True,
                           env=dict(os.environ, GREYHOUND_EXCLUDE_HOSTS=",".join(new_hosts)))
        if req.get("layer_split"):
            layer_split = [int(x) for x in req["layer_split"]]
        _report(control, {"launch": restarts, "plan": handled, "exclude": excluded,
                          "where": req.get("where") or [], "nproc": nproc,
                          "avoid_cpus": sorted(avoid.cpus), "avoid_gpus": sorted(avoid.gpus),
                          "other_hosts": new_hosts})
        say(f"plan {handled}: restarting from {req.get('checkpoint')}"
            + (f" without ranks {excluded} of launch {restarts - 1}" if excluded else "")
            + (f", avoiding CPUs {sorted(avoid.cpus)}" if avoid.cpus else "")
            + (f", GPUs {sorted(avoid.gpus)}" if avoid.gpus else "")
            + (f", hosts {new_hosts}" if new_hosts else "")
            + (f" with layers per stage {layer_split}" if layer_split else ""))
        saved_ns = int(req.get("saved_ns", time.time_ns()))
        for ack in control.parent.glob(f"{control.name}.ack.*"):
            ack.unlink(missing_ok=True)       # the old job's ranks are gone
        _measure_restart_in_background(control, saved_ns, nproc)


def _report(control: Path, doc: dict) -> None:
    """One JSON line per relaunch in `<control>.exclusions`."""
    try:
        with open(f"{control}.exclusions", "a") as fh:
            fh.write(json.dumps(doc) + "\n")
    except OSError as e:
        say(f"cannot record the exclusions in {control}.exclusions: {e.strerror}")


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
