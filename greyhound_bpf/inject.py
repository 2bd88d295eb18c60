"""Fault injection: slow a process, a link or a GPU down for real, and undo it.

- ``CpuQuota`` puts a process in a CPU cgroup of its own with a CFS quota
  (the CPU analogue of locking a GPU's clock), on whichever hierarchy holds
  the cpu controller, found at run time (``cpu_controller``): cgroup v1
  (``cpu.cfs_quota_us``, every thread moved) or v2 (``cpu.max``, the process
  moved through ``cgroup.procs``). On v2 the group is a child of the rank's
  own cgroup when the hierarchy allows it (the rank alone there), else of
  the nearest ancestor that can hold one, so a container's own limit still
  applies where it can; undo puts the process back where it was.
- ``LinkRate`` puts a tbf rate limit on a network interface (this kernel has
  no netem), as competing traffic on a link would.
- ``GpuClock`` locks a GPU's clock through NVML, where the driver allows it.

Each is a context manager with explicit apply()/undo(); undo() restores what
was there. While applied, each keeps a small state file under STATE_DIR so
that `greyhound-trace inject --undo-all` can clean up after a process that
was killed before it could undo (``undo_all``).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import uuid
from pathlib import Path

from . import GreyhoundError
from .diagnosis.cpu import (IDLE_PREFIX, CpuController, _cgroup_mounts, _words,  # noqa: F401
                             cgroup_path, cpu_controller, idle_group_owner_alive,
                             move_out_and_remove)
from .probe.discovery import threads_of

STATE_DIR = Path(os.environ.get("GREYHOUND_STATE_DIR", "/run/greyhound/inject"))
# The tbf qdisc's handle ("gh"): how undo_all recognises our qdiscs.
TBF_HANDLE = "6768:"
GROUP_PREFIX = "greyhound-"
# CFS enforces the quota per period. With the default 100 ms period a rank
# whose iterations take 10 ms runs unthrottled for a few iterations and then
# stalls for tens of ms: spikes, not a slower GPU. A 2 ms period spreads the
# throttling evenly over every iteration, like a lowered clock.
PERIOD_US = 2_000
MIN_QUOTA_US = 1_000


class CpuQuota:
    def __init__(self, pid: int, quota: float, controller: CpuController | None = None,
                 period_ms: float | None = None):
        """`period_ms`: the CFS period to enforce the quota over (default
        PERIOD_US, or longer where the quota needs it). The kernel's own
        default, 100 ms, is what systemd's CPUQuota=, Docker's --cpus and
        Kubernetes' CPU limits use: a rank then runs unthrottled for part of
        each period and stalls for the rest, an intermittent straggler."""
        if not quota > 0:
            raise GreyhoundError(f"quota must be positive (cores), not {quota}")
        if quota < 0.001:
            raise GreyhoundError(f"quota {quota} is below the kernel's 1 ms per second")
        if not os.path.exists(f"/proc/{pid}"):
            raise GreyhoundError(f"no process with PID {pid}")
        if period_ms is not None and not 1 <= period_ms <= 1_000:
            raise GreyhoundError(f"a CFS period is 1 ms to 1 s, not {period_ms:g} ms")
        self.period_us = None if period_ms is None else round(period_ms * 1e3)
        self.ctl = controller or cpu_controller()
        self.pid, self.quota = pid, quota
        self.name = f"{GROUP_PREFIX}{pid}-{uuid.uuid4().hex[:8]}"
        self.group = self.ctl.root / self.name        # v2: placed by apply()
        self._origin: Path | None = None
        self._enabled: Path | None = None             # v2: where we turned on +cpu

    def limit(self) -> tuple[int, int]:
        """(quota_us, period_us) as the kernel holds them."""
        if self.ctl.version == 1:
            return (int((self.group / "cpu.cfs_quota_us").read_text()),
                    int((self.group / "cpu.cfs_period_us").read_text()))
        q, per = (self.group / "cpu.max").read_text().split()
        return int(q), int(per)

    def apply(self) -> "CpuQuota":
        self._origin = cgroup_path(self.pid, self.ctl)
        # The kernel takes quotas of 1 ms at least: a small share needs a
        # longer period (0.3 CPU: 1 ms every 3.3 ms).
        period = min(1_000_000, max(self.period_us or PERIOD_US,
                                    math.ceil(MIN_QUOTA_US / self.quota)))
        quota = max(MIN_QUOTA_US, int(self.quota * period))
        if self.ctl.version == 1:
            self.group.mkdir()
            self.ctl.set_bandwidth(self.group, quota, period)
            # Every thread: in cgroup v1 a thread moves on its own.
            for tid in threads_of(self.pid):
                try:
                    (self.group / "tasks").write_text(str(tid))
                except OSError:
                    pass   # exited meanwhile
        else:
            self._apply_v2(quota, period)
        _save_state(self.name, {"kind": "compute", "version": self.ctl.version,
                                "group": str(self.group), "origin": str(self._origin),
                                "enabled": str(self._enabled) if self._enabled else None,
                                "pid": self.pid})
        return self

    def _apply_v2(self, quota: int, period: int) -> None:
        origin = self._origin
        alone = _words(origin / "cgroup.procs") == [str(self.pid)]
        parent = None
        for c in [origin, *origin.parents]:
            if c != self.ctl.root and self.ctl.root not in c.parents:
                break
            if "cpu" in _words(c / "cgroup.subtree_control") and c != origin:
                parent = c
                break
            if "cpu" not in _words(c / "cgroup.controllers"):
                continue
            # +cpu needs a cgroup without processes (the root is exempt):
            # the rank's own group qualifies once the rank, alone in it,
            # has moved into the child.
            if c == self.ctl.root or (c == origin and alone) or \
                    (c != origin and not _words(c / "cgroup.procs")):
                parent = c
                break
        if parent is None:
            raise GreyhoundError(f"no cgroup v2 group around pid {self.pid} can take the cpu "
                                 "controller (its own holds other processes)", exit_code=1)
        self.group = parent / self.name
        self.group.mkdir()
        try:
            if parent == origin:
                (self.group / "cgroup.procs").write_text(str(self.pid))
            if "cpu" not in _words(parent / "cgroup.subtree_control"):
                (parent / "cgroup.subtree_control").write_text("+cpu")
                self._enabled = parent
            self.ctl.set_bandwidth(self.group, quota, period)
            if parent != origin:
                (self.group / "cgroup.procs").write_text(str(self.pid))
        except OSError as e:
            _release_v2(self.group, origin, self._enabled)
            raise GreyhoundError(f"cgroup v2 refused the quota for pid {self.pid} ({e})",
                                 exit_code=1) from None

    def undo(self) -> None:
        if not self.group.exists():
            return
        back = self._origin if self._origin and self._origin.exists() else self.ctl.root
        if self.ctl.version == 1:
            move_out_and_remove(self.group, back)
        else:
            _release_v2(self.group, back, self._enabled)
        _drop_state(self.name)

    def __enter__(self) -> "CpuQuota":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


def leftover_groups() -> list[Path]:
    """Our CPU groups on every hierarchy (the controller may have moved):
    injections' groups, and idle groups of tracers that are gone (a running
    tracer's own is not left over)."""
    found = []
    for key, mnt in _cgroup_mounts().items():
        if key == "":
            for d, subdirs, _ in os.walk(mnt):
                found += [Path(d) / s for s in subdirs if s.startswith(GROUP_PREFIX)]
                subdirs[:] = [s for s in subdirs if not s.startswith(GROUP_PREFIX)]
        elif "cpu" in key.split(","):
            found += mnt.glob(f"{GROUP_PREFIX}*")
    return sorted(g for g in found
                  if not (g.name.startswith(IDLE_PREFIX) and idle_group_owner_alive(g)))


def _release_v2(group: Path, back: Path, enabled: Path | None) -> None:
    """Processes back to `back`, the group removed, and +cpu turned off
    where we turned it on once no group of ours needs it there. A cgroup
    with controllers on for its children holds no processes, so when the
    rank's own group is `enabled`, +cpu goes off first."""
    def off():
        if enabled is not None and not any(
                p.name.startswith(GROUP_PREFIX) and p != group for p in enabled.iterdir()
                if p.is_dir()):
            try:
                (enabled / "cgroup.subtree_control").write_text("-cpu")
            except OSError:
                pass   # someone below enabled it meanwhile: leave it on
    if enabled == back:
        off()
    move_out_and_remove(group, back)
    if enabled != back:
        off()


def _save_state(name: str, doc: dict) -> None:
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{name}.json").write_text(json.dumps(doc))
    except OSError:
        pass       # undo_all also finds leftovers without it


def _drop_state(name: str) -> None:
    try:
        (STATE_DIR / f"{name}.json").unlink()
    except OSError:
        pass


def _tc(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        raise GreyhoundError("`tc` is not installed (apt install iproute2)", exit_code=1) from None


def parse_rate(text: str) -> int:
    """'400mbit' -> bits per second (tc's units: bit, kbit, mbit, gbit)."""
    t = text.strip().lower()
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if t.endswith(unit):
            num = t[: -len(unit)]
            break
    else:
        num, mult = t, 1
    try:
        v = float(num) * mult
    except ValueError:
        raise GreyhoundError(f"not a rate: {text!r} (for example 400mbit)") from None
    if v < 8_000:
        raise GreyhoundError(f"rate {text!r} is below 8kbit")
    return int(v)


class LinkRate:
    """A tbf rate limit as the root qdisc of `dev`. Refuses to replace a
    root qdisc someone configured (anything but the kernel's default)."""

    def __init__(self, dev: str, rate: str):
        if not Path(f"/sys/class/net/{dev}").exists():
            raise GreyhoundError(f"no network interface {dev!r} (see `ip link`)")
        self.dev, self.bits = dev, parse_rate(rate)
        self.name = f"link-{dev}"

    def _root(self) -> str:
        out = _tc("qdisc", "show", "dev", self.dev, "root").stdout.strip()
        return out.splitlines()[0] if out else ""

    def apply(self) -> "LinkRate":
        root = self._root()
        if root and TBF_HANDLE not in root and not any(
                root.startswith(f"qdisc {q} ") for q in ("noqueue", "pfifo_fast", "fq_codel",
                                                        "mq", "noop", "fq")):
            raise GreyhoundError(f"{self.dev} already has a configured root qdisc ({root}); "
                                 "not replacing it")
        # Burst: at least one MTU-sized packet and ~1 ms at the rate.
        burst = max(16_384, self.bits // 8 // 1000)
        r = _tc("qdisc", "replace", "dev", self.dev, "root", "handle", TBF_HANDLE, "tbf",
                "rate", f"{self.bits}bit", "burst", str(burst), "latency", "50ms")
        if r.returncode != 0:
            raise GreyhoundError(f"tc could not limit {self.dev}: {r.stderr.strip()}",
                                 exit_code=1)
        _save_state(self.name, {"kind": "link", "dev": self.dev})
        return self

    def undo(self) -> None:
        if TBF_HANDLE in self._root():
            _tc("qdisc", "del", "dev", self.dev, "root", "handle", TBF_HANDLE)
        _drop_state(self.name)

    def __enter__(self) -> "LinkRate":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


class GpuClock:
    """Lock GPU `index` to `mhz` through NVML (nvmlDeviceSetGpuLockedClocks);
    undo() resets the locked clocks. Needs the NVIDIA driver and, on most
    boards, root."""

    def __init__(self, index: int, mhz: int):
        if mhz <= 0:
            raise GreyhoundError(f"clock must be positive MHz, not {mhz}")
        self.index, self.mhz = index, mhz
        self.name = f"gpu-{index}"
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception as e:     # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise GreyhoundError(f"cannot lock GPU clocks here: NVML is not available ({e}); "
                                 "this needs an NVIDIA GPU and its driver", exit_code=1) from None
        self.nvml = pynvml
        n = pynvml.nvmlDeviceGetCount()
        if not 0 <= index < n:
            raise GreyhoundError(f"no GPU {index}: this machine has {n}")
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def apply(self) -> "GpuClock":
        if (STATE_DIR / f"{self.name}.json").exists():
            raise GreyhoundError(f"GPU {self.index} is already locked by another greyhound "
                                 "inject (or one that was killed: inject --undo-all)")
        try:
            self.nvml.nvmlDeviceSetGpuLockedClocks(self.handle, self.mhz, self.mhz)
        except self.nvml.NVMLError as e:
            raise GreyhoundError(f"the driver refused to lock GPU {self.index} at {self.mhz} MHz "
                                 f"({e}); locked clocks need root and a board that supports "
                                 "them (Volta or newer)", exit_code=1) from None
        _save_state(self.name, {"kind": "gpu-clock", "gpu": self.index})
        return self

    def undo(self) -> None:
        """Unlock the clocks. NVML has no call that reads a lock back, so a
        lock someone else had set before is not restored: apply() refuses
        to run over a state file of another greyhound lock, and the README
        says to check `nvidia-smi -q -d CLOCK` first."""
        try:
            self.nvml.nvmlDeviceResetGpuLockedClocks(self.handle)
        except self.nvml.NVMLError:
            pass
        finally:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass
        _drop_state(self.name)

    def __enter__(self) -> "GpuClock":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


def undo_all() -> list[str]:
    """Undo every injection left behind: greyhound cgroups (their processes
    go back to the group they came from, or the root), tbf qdiscs with our
    handle on any interface, GPU clocks we locked. Returns what was undone."""
    done = []
    states = {}
    if STATE_DIR.is_dir():
        for f in STATE_DIR.glob("*.json"):
            try:
                states[f.stem] = json.loads(f.read_text())
            except (OSError, ValueError):
                pass
    for group in leftover_groups():
        st = states.get(group.name, {})
        origin = Path(st.get("origin") or group.parent)
        origin = origin if origin.exists() else group.parent
        try:
            if (group / "tasks").exists():
                move_out_and_remove(group, origin)
            else:
                _release_v2(group, origin, Path(st["enabled"]) if st.get("enabled") else None)
            done.append(f"cgroup {group}")
        except OSError as e:
            done.append(f"cgroup {group}: could not remove ({e})")
        _drop_state(group.name)
    for dev in sorted(p.name for p in Path("/sys/class/net").iterdir()):
        out = _tc("qdisc", "show", "dev", dev, "root").stdout
        if f"qdisc tbf {TBF_HANDLE}" in out:
            _tc("qdisc", "del", "dev", dev, "root", "handle", TBF_HANDLE)
            done.append(f"tbf on {dev}")
        _drop_state(f"link-{dev}")
    for name, st in states.items():
        if st.get("kind") == "gpu-clock":
            try:
                g = GpuClock(int(st["gpu"]), 1)
                g.undo()
                done.append(f"GPU {st['gpu']} clocks reset")
            except GreyhoundError as e:
                done.append(f"GPU {st['gpu']}: {e}")
            _drop_state(name)
    return done
