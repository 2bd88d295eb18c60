"""Who is who across nodes: the job's identity as its ranks' environments
give it, the names of its Redis streams, and the census of the ranks the
agents announce. Pure; stdlib only.

A job is named by the first of these a rank has: `TORCHELASTIC_RUN_ID`
(torchrun's `--rdzv-id`; "none", its default, names nothing),
`SLURM_JOB_ID`, then `MASTER_ADDR:MASTER_PORT` (every rank of one job
has the same rendezvous). `--job` overrides. Names go into Redis keys and
ACL key patterns, so a job or node name is letters, digits and `._-` only:
anything else is refused with the name in the message, never quoted into
a pattern.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class IdentityError(ValueError):
    pass


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise IdentityError(f"{what} {name!r}: use letters, digits and ._- (at most 100, "
                            "starting with a letter or digit)")
    return name


def job_identity(env: dict[str, str]) -> str | None:
    """The job's name from a rank's environment, or None."""
    for var in JOB_VARS:
        v = env.get(var, "").strip()
        if v and v != "none":
            return _safe(v)
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if addr and port.isdigit():
        return _safe(f"{addr}-{port}")
    return None


def _safe(v: str) -> str:
    """A name from the environment, made a key name (other characters -> `_`)."""
    v = re.sub(r"[^A-Za-z0-9._-]", "_", v)[:100]
    return v if v[:1].isalnum() else f"j{v}"[:100]


def events_stream(job: str, node: str) -> str:
    """The stream a node's agent alone may write."""
    return f"gh:{check_name('job', job)}:ev:{check_name('node', node)}"


def commands_stream(job: str) -> str:
    """The controller's requests and plans, read by every agent."""
    return f"gh:{check_name('job', job)}:cmd"


@dataclass
class Census:
    """Ranks 0..world-1, each announced exactly once across the nodes."""
    world: int | None
    where: dict[int, list[str]] = field(default_factory=dict)   # rank -> nodes announcing it
    worlds: set = field(default_factory=set)                    # world sizes announced
    missing: list[int] = field(default_factory=list)
    twice: dict[int, list[str]] = field(default_factory=dict)
    outside: list[int] = field(default_factory=list)            # ranks >= world or < 0

    @property
    def complete(self) -> bool:
        return (self.world is not None and len(self.worlds) == 1 and not self.missing
                and not self.twice and not self.outside)

    def problems(self) -> list[str]:
        out = []
        if len(self.worlds) > 1:
            out.append(f"ranks disagree on the world size: {sorted(self.worlds)}")
        if self.missing:
            out.append(f"no node announced {len(self.missing)} rank(s): "
                       f"{spans(self.missing)}")
        for r, nodes in sorted(self.twice.items()):
            out.append(f"rank {r} announced {len(nodes)} times (nodes {', '.join(nodes)})")
        if self.outside:
            out.append(f"rank(s) {self.outside} outside a world of {self.world}")
        return out


def spans(ranks: list[int], most: int = 8) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (the first `most` spans, then how many more)."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out[:most])
    return text + (f" and {len(out) - most} more span(s)" if len(out) > most else "")


def census(hellos: dict[str, list[dict]]) -> Census:
    """`hellos`: node -> the ranks its agent announced (each with `rank` and
    `world_size`)."""
    where: dict[int, list[str]] = {}
    worlds = set()
    for node in sorted(hellos):
        for r in hellos[node]:
            if isinstance(r.get("rank"), int):
                where.setdefault(r["rank"], []).append(node)
            if isinstance(r.get("world_size"), int):
                worlds.add(r["world_size"])
    world = max(worlds) if worlds else None
    c = Census(world, where, worlds)
    if world is not None:
        c.missing = [r for r in range(world) if r not in where]
        c.outside = sorted(r for r in where if not 0 <= r < world)
    c.twice = {r: nodes for r, nodes in where.items() if len(nodes) > 1}
    return c
