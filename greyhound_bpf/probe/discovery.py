"""Target discovery: from the PIDs a user names to the ranks we probe.

A PID may be a rank or a launcher (torchrun, mpirun, srun, a shell script).
Every scan walks the process tree under the roots, reads each process's
/proc/PID/maps for probed libraries and its environment for the rank, and
reports processes that appeared or exited since the last scan. Paths are
resolved through /proc/PID/root, so a rank inside a container is probed on
the library it really mapped.
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

# Command lines of launchers: they import torch (and so map libtorch_cpu)
# but run no collectives, so they are not ranks.
LAUNCHER_MARKERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch",
                    "mpirun", "mpiexec", "srun", "deepspeed")


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

    def describe(self) -> dict:
        return {"pid": self.pid, "rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size, "comm": self.comm,
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


def is_launcher(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    # Only the program and the module (`python -m torch.distributed.run`).
    head = b" ".join(argv[:3]).decode("utf-8", "replace")
    return any(m in head for m in LAUNCHER_MARKERS)


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
        for pid in self.tree:
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
            if is_launcher(pid):
                self._launchers[pid] = stats[pid].start_time
                continue
            rank, local_rank, world = rank_identity(pid)
            owner = self._rank_above(pid, (rank, world), stats, identity)
            if owner is not None:
                self.subprocesses[pid] = owner
                self.new_subprocesses.append((pid, owner))
                continue
            st = stats[pid]
            t = Target(pid, st.start_time, st.comm, rank, local_rank, world, libs)
            self.targets[pid] = t
            new.append(t)
        return new, exited, grown

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
                cache[p] = (rank_identity(p)[::2] if not is_launcher(p)
                            and (p in self.targets or mapped_libraries(p, self.catalog))
                            else None)
            if cache[p] == ident:
                found = p
            if p in self.roots:
                break
            p = stats[p].ppid
        return self.subprocesses.get(found, found) if found is not None else None
