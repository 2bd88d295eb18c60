"""Start-up at SCHED_IDLE and in an idle CPU group (diagnosis.cpu.Background,
IdleGroup), in a child process so that pytest's own threads keep their
scheduling and group; idle validation workers wait in that group."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from greyhound_bpf.diagnosis.cpu import Background
from greyhound_bpf.probe.discovery import threads_of

def policies():
    return sorted({os.sched_getscheduler(t) for t in threads_of(os.getpid())})

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()     # a thread from before
bg = Background(nice=5, max_s=float(sys.argv[2])).enter()
later = threading.Thread(target=stop.wait, daemon=True)      # one created while idle
later.start()
out = {"idle": policies(), "later": os.sched_getscheduler(later.native_id)}
if bg.max_s < 1:
    time.sleep(bg.max_s + 0.5)                                # the watchdog's turn
else:
    bg.restore()
bg.restore()                                                  # twice is harmless
main_tid = threading.main_thread().native_id
out.update(after=policies(), nice=os.getpriority(os.PRIO_PROCESS, main_tid),
           later_nice=os.getpriority(os.PRIO_PROCESS, later.native_id),
           timed_out=bg.timed_out)
print(json.dumps(out))
"""


def run_child(max_s: float, code: str = CHILD) -> dict:
    """What a child process running `code` (ROOT and max_s its arguments) printed."""
    r = subprocess.run([sys.executable, "-c", code, str(ROOT), str(max_s)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_start_up_is_idle_then_restored_at_nice():
    got = run_child(20.0)
    # Every thread idle except the watchdog (SCHED_OTHER, so that it runs).
    assert got["idle"] == sorted({0, 5}) and got["later"] == 5, got    # OTHER=0, IDLE=5
    assert got["after"] == [0] and got["nice"] == 5 and got["later_nice"] == 5, got
    assert got["timed_out"] is False


def test_a_start_up_that_lasts_is_restored_by_the_watchdog():
    got = run_child(0.3)
    assert got["timed_out"] is True and got["after"] == [0] and got["nice"] == 5, got


# -- the idle CPU group (needs root: it makes a cgroup) ----------------------------

GROUP_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from greyhound_bpf.diagnosis.cpu import Background, cgroup_path

bg = Background(nice=5, max_s=20.0).enter()
assert bg.group is not None, bg.group
ctl = bg.group.ctl
path = bg.group.path
out = {"path": str(path), "idle": str(cgroup_path(os.getpid(), ctl)),
       "cpu_idle": (path / "cpu.idle").read_text().strip()}
bg.restore()
out["after"] = str(cgroup_path(os.getpid(), ctl))
out["kept"] = path.is_dir()
bg.close()
out["removed"] = not path.exists()
out["root"] = str(ctl.root)
print(json.dumps(out))
"""


@pytest.mark.bpf
def test_start_up_runs_in_an_idle_cpu_group_then_goes_home():
    got = run_child(20.0, GROUP_CHILD)
    # While starting: in greyhound-idle-<pid>, marked idle for the scheduler
    # (SCHED_IDLE alone ranks it only within its own autogroup).
    assert got["idle"] == got["path"] and Path(got["path"]).name.startswith("greyhound-idle-")
    assert got["cpu_idle"] == "1", got
    # Probes in: back where it came from (here the root); the group stays for
    # idle validation workers until close().
    assert got["after"] == got["root"] and got["kept"] and got["removed"], got


@pytest.mark.bpf
def test_an_idle_group_left_by_a_killed_tracer_is_cleaned_and_counted():
    from greyhound_bpf.diagnosis.cpu import IDLE_PREFIX, IdleGroup, cpu_controller
    from greyhound_bpf.inject import leftover_groups
    dead = subprocess.Popen(["true"])
    dead.wait()                                  # a pid that no longer runs
    stale = cpu_controller().root / f"{IDLE_PREFIX}{dead.pid}"
    stale.mkdir()
    try:
        assert stale in leftover_groups()        # a dead tracer's group is left over
        mine = IdleGroup.create()                # the next start removes it
        assert mine is not None and not stale.exists()
        assert mine.path not in leftover_groups()    # a live tracer's is not
        mine.remove()
        assert not mine.path.exists()
    finally:
        if stale.exists():
            stale.rmdir()


@pytest.mark.bpf
def test_a_validation_worker_waits_in_the_idle_group():
    from greyhound_bpf.diagnosis.cpu import IdleGroup, cgroup_path, cgroups_of
    from greyhound_bpf.diagnosis.host import Member
    from greyhound_bpf.diagnosis.workers import Worker
    group = IdleGroup.create()
    assert group is not None, IdleGroup.why_not
    # A "rank" in our own groups: place() moves the worker there to measure.
    w = Worker(Member(0, cgroups=cgroups_of(os.getpid())), 1, 30.0, idle_group=group)
    try:
        # From its first moment (its torch import is the CPU the job would lose).
        assert cgroup_path(w.proc.pid, group.ctl) == group.path
        w.place()                                # measuring: back among normal tasks
        assert cgroup_path(w.proc.pid, group.ctl) != group.path
        w.idle()
        assert cgroup_path(w.proc.pid, group.ctl) == group.path
    finally:
        w.kill()
        group.remove()
    assert not group.path.exists()


@pytest.mark.bpf
def test_an_idle_group_can_be_made_ordinary_for_a_start_up_that_cannot_wait():
    from greyhound_bpf.diagnosis.cpu import IdleGroup
    group = IdleGroup.create()
    assert group is not None, IdleGroup.why_not
    try:
        group.set_idle(False)       # validation workers past IDLE_START_MAX_S
        assert (group.path / "cpu.idle").read_text().strip() == "0"
        group.set_idle(True)
        assert (group.path / "cpu.idle").read_text().strip() == "1"
    finally:
        group.remove()


CAP_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from greyhound_bpf.diagnosis.cpu import Background

def quota(g):
    if g.ctl.version == 1:
        return int((g.path / "cpu.cfs_quota_us").read_text()), \
            int((g.path / "cpu.cfs_period_us").read_text())
    q, p = (g.path / "cpu.max").read_text().split()
    return (-1 if q == "max" else int(q)), int(p)

bg = Background(nice=5, max_s=20.0, cpu_cap=0.25).enter()
g = bg.group
out = {"capped": bg.capped, "during": quota(g), "max_s": bg.max_s}
bg.restore()
out["after"] = quota(g)
bg.close()
print(json.dumps(out))
"""


@pytest.mark.bpf
def test_a_capped_start_up_is_capped_until_the_probes_are_in():
    # --start-cpu 0.25: the group's CFS quota is a quarter of its period while
    # starting, lifted at restore (validation workers wait there later), and
    # the watchdog gives a capped start-up time to finish.
    got = run_child(20.0, CAP_CHILD)
    q, period = got["during"]
    assert got["capped"] and q == period // 4, got
    assert got["after"][0] == -1 and got["max_s"] == 20.0, got


def test_start_cpu_is_read_before_argparse_and_a_bad_one_left_to_it():
    from greyhound_bpf.cli import _early_start_cpu, build_parser
    assert _early_start_cpu(["attach", "42", "--start-cpu", "0.2"]) == 0.2
    assert _early_start_cpu(["attach", "--start-cpu=0.3", "42"]) == 0.3
    assert _early_start_cpu(["attach", "42"]) is None
    for bad in ("0", "2", "x"):
        assert _early_start_cpu(["attach", "42", "--start-cpu", bad]) is None
        with pytest.raises(SystemExit):
            build_parser().parse_args(["attach", "42", "--start-cpu", bad])
    assert _early_start_cpu(["attach", "42", "--start-cpu"]) is None
