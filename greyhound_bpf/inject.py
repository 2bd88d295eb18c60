"""Fault injection: slow a process down for real, and undo it.

``CpuQuota`` puts a process in a cgroup v1 CPU group of its own with a CFS
quota (the CPU analogue of locking a GPU's clock). It is a context manager
and also has explicit apply()/undo(); undo() moves the process back and
removes the group, so nothing is left behind.
"""
from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

from . import GreyhoundError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
GROUP_PREFIX = "greyhound-"
# CFS enforces the quota per period. With the default 100 ms period a rank
# whose iterations take 10 ms runs unthrottled for a few iterations and then
# stalls for tens of ms: spikes, not a slower GPU. A 2 ms period spreads the
# throttling evenly over every iteration, like a lowered clock.
PERIOD_US = 2_000
MIN_QUOTA_US = 1_000


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class CpuQuota:
    def __init__(self, pid: int, quota: float, root: Path = CPU_ROOT):
        if not quota > 0:
            raise GreyhoundError(f"quota must be positive (cores), not {quota}")
        if not (root / "cpu.cfs_quota_us").exists():
            raise GreyhoundError(f"no cgroup v1 cpu controller at {root}", exit_code=1)
        if not os.path.exists(f"/proc/{pid}"):
            raise GreyhoundError(f"no process with PID {pid}")
        self.pid, self.quota, self.root = pid, quota, root
        if quota < 0.001:
            raise GreyhoundError(f"quota {quota} is below the kernel's 1 ms per second")
        self.group = root / f"{GROUP_PREFIX}{pid}-{uuid.uuid4().hex[:8]}"
        self._origin: Path | None = None

    def _origin_group(self) -> Path:
        for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return self.root / path.lstrip("/")
        return self.root

    def apply(self) -> "CpuQuota":
        self._origin = self._origin_group()
        self.group.mkdir()
        # The kernel takes quotas of 1 ms at least: a small share needs a
        # longer period (0.3 CPU: 1 ms every 3.3 ms).
        period = min(1_000_000, max(PERIOD_US, math.ceil(MIN_QUOTA_US / self.quota)))
        (self.group / "cpu.cfs_period_us").write_text(str(period))
        (self.group / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US,
                                                               int(self.quota * period))))
        # Every thread: in cgroup v1 a thread moves on its own.
        for tid in _threads(self.pid):
            try:
                (self.group / "tasks").write_text(str(tid))
            except OSError:
                pass   # exited meanwhile
        return self

    def undo(self) -> None:
        if not self.group.exists():
            return
        back = self._origin if self._origin and self._origin.exists() else self.root
        for tid in (self.group / "tasks").read_text().split():
            try:
                (back / "tasks").write_text(tid)
            except OSError:
                pass
        self.group.rmdir()

    def __enter__(self) -> "CpuQuota":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


def leftover_groups(root: Path = CPU_ROOT) -> list[Path]:
    return sorted(root.glob(f"{GROUP_PREFIX}*")) if root.exists() else []
