"""Target discovery: from the PIDs a user names to the ranks we probe.

A PID may be a rank or a launcher (torchrun, mpirun, srun, a shell script,
or a script that calls torch.multiprocessing.spawn). Every scan walks the
process tree under the roots, reads each process's /proc/PID/maps for
probed libraries and its environment for the rank, and reports processes
that appeared or exited since the last scan. Paths are resolved through
/proc/PID/root, so a rank inside a container is probed on the library it
really mapped.

`mp.spawn` (the PyTorch DDP tutorial's launcher) puts no rank in any
environment: it passes the rank to each child as an argument, and starts
child i before child i+1. Its children are Python's spawn children (their
command line ends in `--multiprocessing-fork`), so they are told apart from
a rank's forked workers by that, and numbered in the order they started
(`rank_from: "spawn order"`). A launcher that starts its ranks out of rank
order, and tells them their rank only as an argument, would be numbered
wrongly: nothing outside the process says otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .catalog import Catalog

# Environment variables that carry rank identity, by launcher, in order of
# preference: torchrun / torch.distributed, Open MPI, Slurm.
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")

# Launchers import torch (and so map libtorch_cpu) but run no collectives,
# so they are not ranks. Told by the program they run, never by a substring
# of the command line: a rank running `train_deepspeed.py` or
# `torchrun_demo.py` is a rank. The program: the executable's name, or for
# a Python interpreter its script's name or its `-m` module. The per-node
# daemons that start a node's ranks (Slurm's step daemon, Open MPI's and
# MPICH's proxies) count too: a rank's PID under one names the node's part
# of its job (job_roots).
LAUNCHER_PROGRAMS = frozenset({"torchrun", "mpirun", "mpiexec", "orterun", "prterun", "srun",
                               "deepspeed", "accelerate", "slurmstepd", "orted", "prted",
                               "hydra_pmi_proxy"})
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch",
                    "deepspeed.launcher.")

# The last argument of a child that Python's multiprocessing started with the
# "spawn" method (multiprocessing.spawn.get_command_line): mp.spawn's ranks,
# and a DataLoader's workers when their context is "spawn".
SPAWN_CHILD_ARG = b"--multiprocessing-fork"


@dataclass(frozen=True)
class MappedLib:
    family: str
    path: str        # as the process sees it
    host_path: str   # the same file from our mount namespace
    dev: str
    inode: int


@dataclass
class Target:
    pid: int
    start_time: int              # /proc/PID/stat field 22: tells a reused PID apart
    comm: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    libraries: dict[str, MappedLib] = field(default_factory=dict)
    # Where the rank came from: "environment" (RANK and its kin), "spawn
    # order" (an mp.spawn child, numbered as it started), or None (no rank).
    rank_from: str | None = None

    def label(self, none: str) -> str:
        """"rank N", saying so when the rank was inferred; `none` without one."""
        if self.rank is None:
            return none
        return f"rank {self.rank}" + (" (mp.spawn's order: no RANK in its environment)"
                                      if self.rank_from == "spawn order" else "")

    def describe(self) -> dict:
        return {"pid": self.pid, "rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size, "comm": self.comm, "rank_from": self.rank_from,
                "libraries": {f: m.path for f, m in sorted(self.libraries.items())}}


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    comm: str
    start_time: int


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses: split on the last ')'.
    lpar, rpar = raw.find("("), raw.rfind(")")
    rest = raw[rpar + 2:].split()
    if rest and rest[0] == "Z":      # a zombie has exited; it maps nothing
        return None
    return ProcStat(pid, int(rest[1]), raw[lpar + 1:rpar], int(rest[19]))


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    st = read_stat(pid)
    return st is not None and (start_time is None or st.start_time == start_time)


def all_stats() -> dict[int, ProcStat]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st:
                out[st.pid] = st
    return out


def descendants(roots: list[int], stats: dict[int, ProcStat]) -> list[int]:
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    seen, stack = [], [r for r in roots if r in stats]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.append(pid)
        stack.extend(children.get(pid, ()))
    return sorted(seen)


def mapped_libraries(pid: int, catalog: Catalog) -> dict[str, MappedLib]:
    found: dict[str, MappedLib] = {}
    try:
        with open(f"/proc/{pid}/maps") as fh:
            lines = fh.readlines()
    except OSError:
        return found
    for line in lines:
        if ".so" not in line:
            continue
        parts = line.split(None, 5)
        # Only its code mapped is a library loaded: the dynamic loader maps
        # the whole file read-only first, and a probe's runtime address
        # (tracer.Tracer.attach) is found in its executable mapping.
        if len(parts) < 6 or not parts[5].startswith("/") or "x" not in parts[1]:
            continue
        path = parts[5].rstrip("\n")
        fam = catalog.family_for(path.removesuffix(" (deleted)"))
        if fam is None or fam.name in found:
            continue
        if path.endswith(" (deleted)"):
            # Replaced on disk since it was loaded: the mapping still holds it.
            host = f"/proc/{pid}/map_files/{parts[0]}"
            path = path.removesuffix(" (deleted)")
        else:
            host = f"/proc/{pid}/root{path}"
        found[fam.name] = MappedLib(fam.name, path, host, parts[3], int(parts[4]))
    return found


def threads_of(pid: int) -> list[int]:
    """The thread ids of a process (empty once it has exited)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def read_environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def _first_int(env: dict[str, str], names: tuple[str, ...]) -> int | None:
    for n in names:
        v = env.get(n, "").strip()
        if v.lstrip("-").isdigit():
            return int(v)
    return None


def rank_identity(pid: int) -> tuple[int | None, int | None, int | None]:
    env = read_environ(pid)
    return (_first_int(env, RANK_VARS), _first_int(env, LOCAL_RANK_VARS),
            _first_int(env, WORLD_SIZE_VARS))


def read_argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return []


def program_of(argv: list[bytes]) -> tuple[str, str | None]:
    """(the program's name, the module of `python -m MODULE`, if any): the
    executable's base name, or for a Python interpreter the script's (its
    options skipped; `-c CODE` runs no named program)."""
    args = [a.decode("utf-8", "replace") for a in argv]
    if not args:
        return "", None
    exe = os.path.basename(args[0])
    if not exe.startswith("python"):
        return exe, None
    i = 1
    while i < len(args):
        a = args[i]
        if a == "-m" or (a.startswith("-m") and len(a) > 2):
            mod = args[i + 1] if a == "-m" and i + 1 < len(args) else a[2:]
            return exe, mod
        if a == "-c" or (a.startswith("-c") and len(a) > 2):
            return exe, None
        if a in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2                               # an option with its own argument
            continue
        if not a.startswith("-"):
            return os.path.basename(a), None
        i += 1
    return exe, None


def is_launcher(pid: int) -> bool:
    name, module = program_of(read_argv(pid))
    return (name in LAUNCHER_PROGRAMS
            or (module is not None and module.startswith(LAUNCHER_MODULES)))


def launcher_of(pid: int) -> int | None:
    """The launcher `pid` runs under as one rank of several, or None: its
    parent when that is a launcher (torchrun, mpirun...) and `pid` has a
    rank of a world of two or more in its environment, or when `pid` is a
    spawn child with no rank of its own whose parent is neither a rank nor
    a spawn child (the script that mp.spawn'ed it). Naming one rank's PID
    then names its job: a job's straggler is found by comparing its ranks."""
    st = read_stat(pid)
    if st is None or st.ppid <= 1 or read_stat(st.ppid) is None:
        return None
    rank, _, world = rank_identity(pid)
    if rank is not None:
        return st.ppid if world is not None and world > 1 and is_launcher(st.ppid) else None
    if is_spawn_child(pid) and rank_identity(st.ppid)[0] is None \
            and not is_spawn_child(st.ppid):
        return st.ppid
    return None


def job_roots(pids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The roots to trace for the PIDs a user named: each rank's launcher in
    its place (once), the others as they are; and (pid, launcher) for each
    PID that was widened to its job."""
    roots: list[int] = []
    widened: list[tuple[int, int]] = []
    for pid in pids:
        up = launcher_of(pid)
        if up is not None and up not in pids:
            widened.append((pid, up))
        root = up if up is not None else pid
        if root not in roots:
            roots.append(root)
    return roots, widened


def widened_note(pid: int, launcher: int) -> str:
    """What a user is told when the PID they named was widened to its job."""
    rank, _, world = rank_identity(pid)
    who = (f"rank {rank} of {world}" if rank is not None
           else "one of the ranks mp.spawn started")
    name = program_of(read_argv(launcher))[0] or "its launcher"
    return (f"pid {pid} is {who}, under {name} (pid {launcher}): taking its job, every "
            "rank under that launcher, since a straggler shows only against the other "
            "ranks (--only-named: the PIDs named alone)")


def is_spawn_child(pid: int) -> bool:
    """Started by Python's multiprocessing with the "spawn" method (a new
    interpreter, not a fork of its parent)."""
    argv = read_argv(pid)
    return bool(argv) and argv[-1] == SPAWN_CHILD_ARG


class Discovery:
    """Tracks the probed processes under a set of root PIDs.

    ``scan()`` returns (new targets, exited targets, grown targets). A
    process is a target when it maps at least one probed library and is not
    a launcher; a launcher that maps a library (torchrun imports torch)
    still counts for ``libraries_seen``, so attaching to it waits for its
    ranks. Only ranks are ranks: a descendant of a process with the same
    rank identity (its RANK and WORLD_SIZE, or both absent) is that rank's
    subprocess (a DataLoader worker, a torch.compile worker, a helper it
    forked: they inherit the environment and the mapped libraries). It is
    listed in ``subprocesses`` (pid -> the rank's pid), not probed: its
    calls would interleave with the rank's, and such workers come and go
    with every epoch.

    Without a rank in the environment, sharing it means nothing, so spawn
    children (module docstring) decide: one under a rank is that rank's
    subprocess (a "spawn" DataLoader worker); the others are ranks, numbered
    per parent in the order they started, and a parent with no rank of its
    own that spawned them is their launcher (mp.spawn's script).
    """

    # Every how many scans a known target's maps are read again for a library
    # it loaded late: a torch rank's maps run to thousands of lines, and the
    # job shares the CPUs with us.
    RECHECK_EVERY = 10

    def __init__(self, roots: list[int], catalog: Catalog):
        self.roots = list(roots)
        self.catalog = catalog
        self.targets: dict[int, Target] = {}
        self.libraries_seen = False
        self.tree: list[int] = []
        self._scans = 0
        self._launchers: dict[int, int] = {}    # pid -> start time: seen, never a rank
        self.subprocesses: dict[int, int] = {}  # pid -> pid of the rank it belongs to
        self.new_subprocesses: list[tuple[int, int]] = []   # found by the last scan
        # Spawn children seen, by (pid, start time): True or False, read once.
        self._spawned: dict[tuple[int, int], bool] = {}
        # Per launching parent pid: its spawn-child ranks in start order.
        self._spawn_order: dict[int, list[tuple[int, int]]] = {}

    def roots_alive(self) -> bool:
        return any(pid_alive(p) for p in self.roots)

    def scan(self) -> tuple[list[Target], list[Target], list[Target]]:
        """Returns (new targets, exited targets, targets that mapped another
        probed library since the last scan, such as a lazily loaded libnccl)."""
        stats = all_stats()
        self.tree = descendants(self.roots, stats)
        exited = [t for pid, t in self.targets.items()
                  if pid not in stats or stats[pid].start_time != t.start_time]
        for t in exited:
            del self.targets[t.pid]
        self.subprocesses = {p: r for p, r in self.subprocesses.items() if p in stats}
        self.new_subprocesses = []
        new, grown = [], []
        identity: dict[int, tuple] = {}
        self._scans += 1
        recheck = self._scans % self.RECHECK_EVERY == 0
        spawned = self._spawn_children(stats)
        spawn_parents = {stats[p].ppid for p in spawned}
        # Parents before children (start order): a spawn child's rank, and
        # whether a worker's parent is a rank, are known when it is reached.
        for pid in sorted(self.tree, key=lambda p: (stats[p].start_time, p)):
            if pid == os.getpid():
                continue
            if self._launchers.get(pid) == stats[pid].start_time:
                continue
            if pid in self.subprocesses:
                continue
            if pid in self.targets:
                if not recheck:
                    continue
                t = self.targets[pid]
                libs = mapped_libraries(pid, self.catalog)
                if set(libs) - set(t.libraries):
                    t.libraries.update(libs)
                    grown.append(t)
                continue
            libs = mapped_libraries(pid, self.catalog)
            if not libs:
                continue
            self.libraries_seen = True
            rank, local_rank, world = rank_identity(pid)
            no_identity = rank is None and world is None
            if is_launcher(pid) or (no_identity and pid in spawn_parents
                                    and pid not in spawned):
                self._launchers[pid] = stats[pid].start_time
                continue
            rank_from = "environment" if rank is not None else None
            if no_identity and pid in spawned:
                owner = self._target_rank_above(pid, stats)
                if owner is None:
                    rank, world = self._spawn_rank(pid, stats)
                    local_rank, rank_from = rank, "spawn order"
            else:
                owner = self._rank_above(pid, (rank, world), stats, identity)
            if owner is not None:
                self.subprocesses[pid] = owner
                self.new_subprocesses.append((pid, owner))
                continue
            st = stats[pid]
            t = Target(pid, st.start_time, st.comm, rank, local_rank, world, libs, rank_from)
            self.targets[pid] = t
            new.append(t)
        return new, exited, grown

    def _is_spawned(self, pid: int, stats: dict[int, ProcStat]) -> bool:
        key = (pid, stats[pid].start_time)
        if key not in self._spawned:
            self._spawned[key] = is_spawn_child(pid)       # its command line, read once
        return self._spawned[key]

    def _spawn_children(self, stats: dict[int, ProcStat]) -> set[int]:
        """The spawn children in the tree."""
        out = {pid for pid in self.tree if self._is_spawned(pid, stats)}
        self._spawned = {k: v for k, v in self._spawned.items()
                         if k[0] in stats and stats[k[0]].start_time == k[1]}
        return out

    def _spawn_rank(self, pid: int, stats: dict[int, ProcStat]) -> tuple[int, int]:
        """(rank, world) of a spawn child with no rank of its own: its place
        among its parent's spawn children by start, and how many there are
        (mp.spawn starts child i before i+1 and waits for none). Siblings
        outside the tree count too: a user may name one rank's PID."""
        parent = stats[pid].ppid
        order = self._spawn_order.setdefault(parent, [])
        siblings = sorted((st.start_time, p) for p, st in stats.items()
                          if st.ppid == parent and self._is_spawned(p, stats))
        for s in siblings:
            if s not in order:
                order.append(s)
        return order.index((stats[pid].start_time, pid)), len(order)

    def _target_rank_above(self, pid: int, stats: dict[int, ProcStat]) -> int | None:
        """The nearest ancestor under the roots that is a rank we probe."""
        tree, p = set(self.tree), stats[pid].ppid
        while p in stats and p in tree:
            t = self.targets.get(p)
            if t is not None and t.rank is not None:
                return p
            if p in self.roots:
                break
            p = stats[p].ppid
        return None

    def _rank_above(self, pid: int, ident: tuple, stats: dict, cache: dict) -> int | None:
        """The topmost ancestor under the roots (a root included) that maps a
        probed library and has the same rank identity, if any: `pid` is its
        subprocess. A PID the user named is never a subprocess."""
        if pid in self.roots:
            return None
        tree = set(self.tree)
        found, p = None, stats[pid].ppid
        seen = 0
        while p in stats and p in tree and seen < 64:
            seen += 1
            if p not in cache:
                launcher = self._launchers.get(p) == stats[p].start_time or is_launcher(p)
                cache[p] = (rank_identity(p)[::2] if not launcher
                            and (p in self.targets or mapped_libraries(p, self.catalog))
                            else None)
            if cache[p] == ident:
                found = p
            if p in self.roots:
                break
            p = stats[p].ppid
        return self.subprocesses.get(found, found) if found is not None else None
