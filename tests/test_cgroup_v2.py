"""cgroup v2, for real, on this VM's hybrid hierarchy: the cpu controller is
moved from its v1 mount to the cgroup2 mount for this module (umount the v1
`cpu` hierarchy while it holds no groups, or where something holds that
mount, remount it onto a spare v1-only controller such as net_cls; then
`+cpu` in cgroup2's root subtree_control) and moved back after it, on every
path. Under v2 the
compute injection, its undo on signals and after kill -9 (`inject
--undo-all`), and the live straggler test run again (they are imported from
their modules and run here a second time), plus where the group goes: a
child of the rank's own cgroup when the rank is alone there, else the
nearest ancestor that can hold the cpu controller. On a machine that boots
with v2 the same tests run without the move."""
import os
import subprocess
from pathlib import Path

import pytest

from conftest import loud_skip, run_cli, wait_for
from greyhound_bpf.diagnosis.cpu import _cgroup_mounts, remove_stale_idle_groups
from greyhound_bpf.inject import (GROUP_PREFIX, CpuQuota, cgroup_path, cpu_controller,
                                  leftover_groups)
# Run again here, under v2 (pytest collects what a module imports).
from test_detect_live import test_cpu_quota_is_undone_without_leftovers  # noqa: F401
from test_inject import (sleeper, test_compute_for_expires,  # noqa: F401
                         test_compute_undone_on_signal, test_undo_all_after_sigkill)
from test_straggler_live import test_quota_straggler_is_named_passively_and_by_validation  # noqa: F401,E501

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def _v1_cpu_mount() -> tuple[Path, str] | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _src, opts = (right.split() + ["", "", ""])[:3]
        ctrls = [o for o in opts.split(",") if o in ("cpu", "cpuacct")]
        if fstype == "cgroup" and "cpu" in ctrls:
            return Path(left.split()[4]), ",".join(ctrls)
    return None


def _holders(mnt: Path) -> list[str]:
    """Processes we can see whose cwd, root or an open file is under `mnt`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        links = [f"/proc/{pid}/cwd", f"/proc/{pid}/root"]
        try:
            links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            try:
                if os.readlink(link).startswith(f"{mnt}/") or os.readlink(link) == str(mnt):
                    out.append(f"pid {pid} ({link})")
            except OSError:
                pass
    return out


def _spare_controller() -> str | None:
    """A v1-only controller that no hierarchy holds (hierarchy 0 in
    /proc/cgroups), to remount the cpu hierarchy onto."""
    rows = [ln.split() for ln in Path("/proc/cgroups").read_text().splitlines()[1:]]
    free = {r[0] for r in rows if len(r) == 4 and r[1] == "0" and r[3] == "1"}
    return next((c for c in ("net_cls", "net_prio", "perf_event") if c in free), None)


def _cpu_hierarchy_groups() -> int:
    """Groups the kernel still holds in the cpu controller's hierarchy, its
    root and removed ones not yet freed included (/proc/cgroups)."""
    rows = [ln.split() for ln in Path("/proc/cgroups").read_text().splitlines()[1:]]
    return next(int(r[2]) for r in rows if r[0] == "cpu")


def _remove_orphaned_injections(mnt: Path) -> None:
    """Quota groups of ours (greyhound-PID-*) left by an injector killed
    with SIGKILL whose target has exited too: empty, so nothing of anyone's
    is lost by removing them. A group whose target still runs is another
    injection in progress, and stays (the fixture then refuses to move)."""
    for g in mnt.glob(f"{GROUP_PREFIX}*"):
        pid = g.name[len(GROUP_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}") \
                and not (g / "tasks").read_text().split():
            g.rmdir()


@pytest.fixture(scope="module", autouse=True)
def cpu_on_v2():
    ctl = cpu_controller()
    if ctl.version == 2:            # a machine that boots with v2
        yield ctl
        return
    v2 = _cgroup_mounts().get("")
    v1 = _v1_cpu_mount()
    assert v2 is not None and v1 is not None, "no cgroup2 mount to move the cpu controller to"
    remove_stale_idle_groups(ctl)      # a SIGKILLed tracer's, empty: not the machine's
    _remove_orphaned_injections(v1[0])
    groups = [d for d in v1[0].iterdir() if d.is_dir()]
    assert not groups, f"the v1 cpu hierarchy holds groups {groups[:3]}: cannot move it"
    # A group just removed lingers in the kernel a moment (its count in
    # /proc/cgroups): unmounted then, the hierarchy would stay, cpu with it.
    wait_for(lambda: _cpu_hierarchy_groups() == 1, 30,
             "groups removed from the v1 cpu hierarchy to be freed", interval=0.1)
    r = subprocess.run(["umount", str(v1[0])], capture_output=True, text=True)
    spare = None
    if r.returncode != 0:
        # Held by something (here: the sandbox's own init, whose fds even root
        # cannot read). A hierarchy with no groups can still give its
        # controllers up by a remount onto a controller no hierarchy holds.
        spare = _spare_controller()
        m = subprocess.run(["mount", "-o", f"remount,{spare}", "cgroup", str(v1[0])],
                           capture_output=True, text=True) if spare else r
        if m.returncode != 0:
            why = (f"umount {v1[0]} refused ({r.stderr.strip()}), held by "
                   f"{_holders(v1[0]) or 'no process we can see'}, and no remount onto "
                   f"a spare controller ({spare}: {m.stderr.strip()}): the cpu controller "
                   "cannot move to cgroup v2 on this boot")
            loud_skip("CGROUP V2 TESTS DID NOT RUN", why)
    try:
        # The kernel frees the controller from the v1 hierarchy a moment later.
        wait_for(lambda: "cpu" in (v2 / "cgroup.controllers").read_text().split(), 30,
                 "the cpu controller to leave cgroup v1", interval=0.1)
        (v2 / "cgroup.subtree_control").write_text("+cpu")
        ctl = cpu_controller()
        assert ctl == type(ctl)(2, v2)
        yield ctl
    finally:
        left = leftover_groups()
        if left:                           # a failed test's; said below, cleaned first
            run_cli("inject", "--undo-all")
        try:
            if "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("-cpu")
        finally:
            # And from cgroup v2 a moment after -cpu: mount until it is free.
            back = (["mount", "-t", "cgroup", "-o", v1[1], "cgroup", str(v1[0])] if spare is None
                    else ["mount", "-o", f"remount,{v1[1]}", "cgroup", str(v1[0])])
            wait_for(lambda: subprocess.run(back, capture_output=True).returncode == 0,
                     30, "the cpu controller to go back to cgroup v1", interval=0.2)
        assert cpu_controller().version == 1
        assert not left, f"groups left behind under v2: {left}"


def test_check_names_the_hierarchy(cpu_on_v2):
    r = run_cli("check", "--no-load")
    assert f"cgroup v2 at {cpu_on_v2.root}" in r.stdout, r.stdout


@pytest.fixture
def home(cpu_on_v2, sleeper):
    """The sleeper in a cgroup of its own under the v2 root, as a rank in a
    container or a Slurm step is."""
    d = cpu_on_v2.root / "gh-test-home"
    d.mkdir()
    (d / "cgroup.procs").write_text(str(sleeper.pid))
    yield d
    (cpu_on_v2.root / "cgroup.procs").write_text(str(sleeper.pid))
    d.rmdir()


def test_alone_in_its_cgroup_the_group_is_a_child_of_it(home, sleeper):
    with CpuQuota(sleeper.pid, 0.3) as q:
        assert q.group.parent == home and q.limit() == (1000, 3334)
        assert cgroup_path(sleeper.pid, cpu_controller()) == q.group
        assert "cpu" in (home / "cgroup.subtree_control").read_text().split()
    assert cgroup_path(sleeper.pid, cpu_controller()) == home
    assert "cpu" not in (home / "cgroup.subtree_control").read_text().split()
    assert not q.group.exists()


def test_sharing_its_cgroup_the_group_goes_to_an_ancestor(home, sleeper, cpu_on_v2):
    other = subprocess.Popen(["sleep", "300"])
    try:
        (home / "cgroup.procs").write_text(str(other.pid))
        with CpuQuota(sleeper.pid, 0.5) as q:
            assert q.group.parent == cpu_on_v2.root and q.limit() == (1000, 2000)
            assert cgroup_path(other.pid, cpu_controller()) == home
        assert cgroup_path(sleeper.pid, cpu_controller()) == home
        (cpu_on_v2.root / "cgroup.procs").write_text(str(other.pid))
    finally:
        other.kill()
        other.wait()


def test_the_quota_really_limits(sleeper, cpu_on_v2):
    """A busy loop under 0.3 CPU uses about 0.3 CPU."""
    from harness import cpu_share
    busy = subprocess.Popen(["python3", "-c", "while True: pass"])
    try:
        wait_for(lambda: cpu_share(busy.pid, 1) > 0.5, 20, "the loop to run")
        with CpuQuota(busy.pid, 0.3):
            share = cpu_share(busy.pid, 3)
        assert 0.2 < share < 0.4, share
    finally:
        busy.kill()
        busy.wait()
