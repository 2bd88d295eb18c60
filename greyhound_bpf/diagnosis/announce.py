"""Who is validating on this machine, and where that state lives.

Light on purpose (no NumPy, nothing of the probes): `greyhound-trace
validate` announces itself here before its own imports, whose load a
tracer on the machine must not blame on the job (cli.main)."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path


# Per-host state (the validation lock, who is validating) lives under
# /run/greyhound; a cluster agent keys it by its node (set_node), so that
# nodes sharing a kernel (network namespaces on one machine) are nodes.
_NODE: str | None = None


def set_node(node: str | None) -> None:
    global _NODE
    _NODE = node


def state_dir(machine: bool = False) -> Path:
    """This node's state (a node's agent: under nodes/NAME), or with
    `machine` the machine's, which every agent on it shares."""
    base = Path("/run/greyhound") if os.geteuid() == 0 else \
        Path(tempfile.gettempdir()) / f"greyhound-{os.geteuid()}"
    return base / "nodes" / _NODE if _NODE and not machine else base


class Busy:
    """Announces that validation workers are starting or measuring on this
    machine: a file per activity, gone when it ends (a dead writer's file is
    ignored). Both put load on the host (importing torch; a paused job;
    GEMMs), so a tracer on this machine does not blame a job slowdown that
    begins meanwhile on the job (`busy_since`)."""

    def __init__(self, what: str):
        self.what = what
        self.path = None

    @staticmethod
    def directory() -> Path:
        return state_dir() / "validating"

    def __enter__(self) -> "Busy":
        try:
            d = self.directory()
            d.mkdir(parents=True, exist_ok=True)
            self.path = d / f"{os.getpid()}-{id(self):x}.json"
            self.path.write_text(json.dumps({"pid": os.getpid(), "since_ns": time.time_ns(),
                                             "what": self.what}))
        except OSError:
            self.path = None
        return self

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            self.path = None


def busy_since(exclude_pid: int | None = None) -> int | None:
    """Wall-clock ns since when validation has been busy on this machine, or
    None when it is not; `exclude_pid`'s own activity left out (a tracer
    knows its own spans)."""
    from ..probe.discovery import read_stat    # (not at import: the CLI announces first)
    since = None
    try:
        files = list(Busy.directory().glob("*.json"))
    except OSError:
        return None
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if exclude_pid is not None and int(doc.get("pid", 0)) == exclude_pid:
            continue
        if read_stat(int(doc.get("pid", 0))) is None:
            try:
                f.unlink()          # its writer was killed: nothing is busy
            except OSError:
                pass
            continue
        since = doc["since_ns"] if since is None else min(since, doc["since_ns"])
    return since
