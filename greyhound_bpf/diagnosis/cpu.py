"""Our own CPU, and the machine's cgroup hierarchies: where the cpu
controller is (v1 or v2), which groups a process is in, an idle CPU group
for what we run beside the job, and the tracer's start-up in the
background. Standard library only: the command line enters the background
before it imports anything heavy."""
from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import GreyhoundError


def _cgroup_key(ctrls) -> str:
    """A hierarchy's name: its sorted v1 controllers ('cpu,cpuacct'), its
    name= for a named v1 hierarchy, or '' for the v2 unified one."""
    names = [c for c in ctrls if c.startswith("name=")]
    return names[0] if names else ",".join(sorted(c for c in ctrls if c))


def _cgroup_mounts() -> dict[str, Path]:
    out: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for ln in lines:
        left, _, right = ln.partition(" - ")
        fstype, _src, opts = (right.split() + ["", "", ""])[:3]
        mnt = Path(left.split()[4])
        if fstype == "cgroup2":
            out.setdefault("", mnt)
        elif fstype == "cgroup":
            known = {"rw", "ro", "nosuid", "nodev", "noexec", "relatime", "clone_children"}
            key = _cgroup_key([o for o in opts.split(",") if o not in known
                               and (o.startswith("name=") or "=" not in o)])
            if key:
                out.setdefault(key, mnt)
    return out


def cgroups_of(pid: int) -> list[Path]:
    """The cgroup.procs files of every hierarchy `pid` is in (v1 and v2)."""
    mounts = _cgroup_mounts()
    files = []
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return files
    for ln in lines:
        _hid, ctrls, path = ln.split(":", 2)
        mnt = mounts.get(_cgroup_key(ctrls.split(",")))
        if mnt is None:
            continue
        f = mnt / path.lstrip("/") / "cgroup.procs"
        if f.exists():
            files.append(f)
    return files


@dataclass(frozen=True)
class CpuController:
    """Where the cpu controller is: a cgroup v1 hierarchy or cgroup v2."""
    version: int
    root: Path

    def describe(self) -> str:
        return f"cgroup v{self.version} at {self.root}"

    def set_bandwidth(self, group: Path, quota_us: int | None, period_us: int) -> None:
        """CFS bandwidth of `group`: at most quota_us of CPU time every
        period_us (None: no limit). cpu.cfs_period_us and cpu.cfs_quota_us
        in v1, cpu.max in v2. OSError where the kernel refuses it."""
        if self.version == 1:
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text("-1" if quota_us is None else str(quota_us))
        else:
            (group / "cpu.max").write_text(f"{'max' if quota_us is None else quota_us} "
                                           f"{period_us}")


def cpu_controller() -> CpuController:
    """The hierarchy that holds the cpu controller now: a v1 mount with
    `cpu`, or else the v2 mount whose root offers `cpu`."""
    mounts = _cgroup_mounts()
    for key, mnt in mounts.items():
        if key and "cpu" in key.split(","):
            return CpuController(1, mnt)
    v2 = mounts.get("")
    if v2 is not None:
        try:
            if "cpu" in (v2 / "cgroup.controllers").read_text().split():
                return CpuController(2, v2)
        except OSError:
            pass
    raise GreyhoundError("no cgroup cpu controller here: neither a cgroup v1 `cpu` hierarchy "
                         "nor `cpu` in cgroup v2's cgroup.controllers", exit_code=1)


def cgroup_path(pid: int, ctl: CpuController) -> Path:
    """The cgroup of `pid` in the cpu controller's hierarchy."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (ctl.version == 1 and "cpu" in controllers.split(",")) or \
                (ctl.version == 2 and hid == "0" and controllers == ""):
            return ctl.root / path.lstrip("/")
    return ctl.root


def _words(f: Path) -> list[str]:
    try:
        return f.read_text().split()
    except OSError:
        return []


# -- the idle group ---------------------------------------------------------------

# Our start-up and idle validation workers run in a CPU group of this name
# (plus our pid) with cpu.idle set. SCHED_IDLE alone does not keep them off
# the job's CPU: a thread's policy only ranks it among the tasks of its own
# group, and the job is nearly always in another (its own session's
# autogroup, a systemd slice, a Slurm cgroup), which then competes with ours
# as an equal. Measured here (3 gloo ranks on 2 cores): a SCHED_IDLE spin
# loop in another session slowed the job by 22%.
IDLE_PREFIX = "greyhound-idle-"


class IdleGroup:
    """A CPU group of ours marked idle (``cpu.idle``, or the least weight
    where the kernel has no cpu.idle), directly under the cpu controller's
    root: the scheduler then runs whatever is in it only when nothing else
    on the machine wants the CPU, whichever group the job is in. `create()`
    returns None where no such group can be made (no cpu controller, a
    read-only cgroup mount, cgroup v2 without cpu at its root), with the
    reason in `why_not`; callers then have SCHED_IDLE only."""

    why_not = ""

    def __init__(self, ctl: CpuController, path: Path):
        self.ctl, self.path = ctl, path

    @classmethod
    def create(cls) -> "IdleGroup | None":
        try:
            ctl = cpu_controller()
        except GreyhoundError as e:
            cls.why_not = str(e)
            return None
        if ctl.version == 2 and "cpu" not in _words(ctl.root / "cgroup.subtree_control"):
            cls.why_not = f"cgroup v2 at {ctl.root} has no cpu controller for its children"
            return None
        remove_stale_idle_groups(ctl)
        group = cls(ctl, ctl.root / f"{IDLE_PREFIX}{os.getpid()}")
        try:
            group.path.mkdir(exist_ok=True)
            group.set_idle(True)
        except OSError as e:
            cls.why_not = f"cannot make a CPU group under {ctl.root} ({e.strerror})"
            try:
                group.path.rmdir()
            except OSError:
                pass
            return None
        return group

    def set_idle(self, idle: bool) -> None:
        """Idle (runs on CPU nobody else wants), or one ordinary group: the
        weight of one session, shared by everything in it, for a start-up
        that cannot wait any longer."""
        try:
            # cpu.idle=0 gives the group back its weight, never changed here.
            (self.path / "cpu.idle").write_text("1" if idle else "0")
            return
        except OSError:
            pass                                # no cpu.idle (before 5.15): weights only
        if self.ctl.version == 1:
            (self.path / "cpu.shares").write_text("2" if idle else "1024")
        else:
            (self.path / "cpu.weight").write_text("1" if idle else "100")

    def cap(self, cpus: float | None) -> bool:
        """At most `cpus` CPUs' worth of time for everything in the group
        (CFS bandwidth: cpu.cfs_quota_us in v1, cpu.max in v2); None lifts
        it. False where the kernel has no bandwidth control."""
        try:
            if self.ctl.version == 1:
                period = int((self.path / "cpu.cfs_period_us").read_text())
            else:
                period = int((self.path / "cpu.max").read_text().split()[1])
            self.ctl.set_bandwidth(self.path, None if cpus is None else
                                   max(1000, int(cpus * period)), period)
            return True
        except (OSError, ValueError, IndexError):
            return False

    @classmethod
    def check(cls) -> tuple[bool, str]:
        """For `greyhound-trace check`: (whether one can be made, what it means)."""
        group = cls.create()
        if group is None:
            return False, (f"{cls.why_not}: start-up runs at SCHED_IDLE only, which a job "
                           "in another session or cgroup does not outrank")
        group.remove()
        return True, f"start-up and idle workers in {group.ctl.root}/{IDLE_PREFIX}PID"

    def join(self, pid: int) -> bool:
        """Moves `pid`, every thread of it (cgroup.procs moves a whole
        process in v1 and v2)."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:
            return False

    @staticmethod
    def leave(pid: int, home: Path) -> None:
        """Back to `home`, the cpu group it came from (cgroup_path)."""
        try:
            (home / "cgroup.procs").write_text(str(pid))
        except OSError:
            pass               # exited, or home is gone: the group's removal moves it

    def remove(self) -> None:
        """Whoever is still in it goes to the root of the hierarchy (our
        workers are killed before this), then the group goes."""
        _empty_into(self.path, self.ctl.root)


def move_out_and_remove(group: Path, dest: Path, wait_s: float = 2.0) -> None:
    """Every member of `group` into `dest`, then the group removed. A rank
    starts threads all the time and a new one is born in its parent's group,
    so one pass can leave a thread behind and rmdir answers EBUSY: pass
    again until the group is empty or `wait_s` is up (then the error)."""
    members = "tasks" if (group / "tasks").exists() else "cgroup.procs"
    deadline = time.monotonic() + wait_s
    while True:
        for tid in _words(group / members):
            try:
                (dest / members).write_text(tid)
            except OSError:
                pass   # exited meanwhile
        try:
            group.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def _empty_into(group: Path, dest: Path) -> None:
    try:
        move_out_and_remove(group, dest)
    except OSError:
        pass


def idle_group_owner_alive(group: Path) -> bool:
    """Whether the tracer that made this idle group still runs."""
    try:
        pid = int(group.name[len(IDLE_PREFIX):])
    except ValueError:
        return False
    return os.path.exists(f"/proc/{pid}")


def remove_stale_idle_groups(ctl: CpuController) -> list[Path]:
    """Idle groups left by a tracer killed with SIGKILL (empty once it and
    its workers are gone): removed, so a later attach starts clean."""
    gone = []
    for g in ctl.root.glob(f"{IDLE_PREFIX}*"):
        if g.is_dir() and not idle_group_owner_alive(g):
            _empty_into(g, ctl.root)
            gone.append(g)
    return gone


class Background:
    """This process, every thread of it, at SCHED_IDLE and in our idle CPU
    group (IdleGroup) while it starts (importing, compiling the BPF program,
    scanning symbol tables: seconds of CPU that a saturated job would lose).
    `restore()` puts it back in its own group at `nice` once the probes are
    in: a tracer then needs a little CPU, promptly (the ring buffer's
    records), not much. The group stays for validation workers to wait in
    (`group`) until `close()`. A machine the job keeps saturated would
    starve an idle start-up for minutes: after `max_s` a watchdog thread
    (created before the others go idle, so never SCHED_IDLE itself; it
    shares the group, which still gives it the moment it needs) restores
    it anyway.

    Idle priority does not make start-up free: the CPU it runs on is CPU
    the job had left idle, and on a 2-vCPU VM the job's cost follows what
    start-up runs (an idle interpreter alone costs nothing measurable; its
    imports and the BPF compile, +3-6% per 2 s: README, "What attaching
    costs"). `cpu_cap` (CPUs) spreads it thinner: less in any 2 s, the
    probes in later; the watchdog then waits long enough for a capped
    start-up (3 CPU seconds at the cap)."""

    _running: "Background | None" = None

    @classmethod
    def start(cls, cpu_cap: float | None = None) -> "Background":
        """This process's start-up in the background, entered once and
        shared: the command line enters it before its imports, and attach
        takes it over."""
        if cls._running is None:
            cls._running = cls(cpu_cap=cpu_cap).enter()
        return cls._running

    def __init__(self, nice: int = 5, max_s: float = 20.0, cpu_cap: float | None = None):
        self.nice, self.cpu_cap = nice, cpu_cap
        self.max_s = max(max_s, 3.0 / cpu_cap) if cpu_cap else max_s
        self.capped = False
        self.idle = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.timed_out = False
        self.group: IdleGroup | None = None
        self._home: Path | None = None

    def enter(self) -> "Background":
        watchdog = threading.Thread(target=self._watch, name="greyhound-background",
                                    daemon=True)
        watchdog.start()
        self.idle = True
        self._policy(os.SCHED_IDLE, skip=watchdog.native_id)
        self.group = IdleGroup.create()
        if self.group is not None:
            self._home = cgroup_path(os.getpid(), self.group.ctl)
            self.capped = bool(self.cpu_cap) and self.group.cap(self.cpu_cap)
            self.group.join(os.getpid())
        return self

    def close(self) -> None:
        """After the workers are gone: the group removed."""
        self.restore()
        if self.group is not None:
            self.group.remove()
            self.group = None
        if Background._running is self:
            Background._running = None

    def _watch(self) -> None:
        if not self._done.wait(self.max_s):
            self.timed_out = True
            self.restore()

    def restore(self) -> None:
        self._done.set()
        with self._lock:
            if not self.idle:
                return
            self.idle = False
            if self.group is not None and self._home is not None:
                self.group.leave(os.getpid(), self._home)
            if self.capped:                 # validation workers wait there uncapped
                self.group.cap(None)
                self.capped = False
            self._policy(os.SCHED_OTHER)
            for tid in _own_threads():
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                except OSError:
                    pass

    @staticmethod
    def _policy(policy: int, skip: int | None = None) -> None:
        for tid in _own_threads():
            if tid == skip:
                continue
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except OSError:
                pass


def _own_threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]
