"""`greyhound-trace inject`: each fault is really applied while the command
runs and nothing is left after --for, SIGTERM or Ctrl-C; --undo-all cleans
up after a SIGKILLed inject."""
import signal
import subprocess
import uuid

import pytest

from conftest import GREYHOUND, ROOT, run_cli, wait_for
from greyhound_bpf.inject import cgroup_path, cpu_controller, leftover_groups, parse_rate

pytestmark = pytest.mark.bpf        # privileged: cgroups and tc need root


def start_inject(*args):
    return subprocess.Popen([*GREYHOUND, "inject", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def group_of(pid) -> str:
    """The process's group on the hierarchy that holds the cpu controller
    now (v1 or v2: test_cgroup_v2.py runs these tests on v2)."""
    return str(cgroup_path(pid, cpu_controller()))


def quota_us(group) -> int:
    if (group / "cpu.max").exists():
        return int((group / "cpu.max").read_text().split()[0])
    return int((group / "cpu.cfs_quota_us").read_text())


def test_compute_for_expires(sleeper):
    before, home = leftover_groups(), group_of(sleeper.pid)
    p = start_inject("compute", "--pid", str(sleeper.pid), "--quota", "0.5", "--for", "1.5")
    wait_for(lambda: "greyhound-" in group_of(sleeper.pid), 20, "the quota")
    grp = [g for g in leftover_groups() if g not in before][0]
    assert quota_us(grp) == 1000
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "for 1.5 s" in out and "undone" in out
    assert leftover_groups() == before and group_of(sleeper.pid) == home


def period_us(group) -> int:
    if (group / "cpu.max").exists():
        return int((group / "cpu.max").read_text().split()[1])
    return int((group / "cpu.cfs_period_us").read_text())


def test_compute_period_as_a_container_limit_throttles(sleeper):
    """--period-ms 100: the quota over the kernel's default period (what
    Docker's --cpus and Kubernetes' limits set), where the default is an
    even 2 ms period; a period the kernel would refuse is a one-line error."""
    before = leftover_groups()
    p = start_inject("compute", "--pid", str(sleeper.pid), "--quota", "0.3",
                     "--period-ms", "100", "--for", "1")
    wait_for(lambda: "greyhound-" in group_of(sleeper.pid), 20, "the quota")
    grp = [g for g in leftover_groups() if g not in before][0]
    assert (quota_us(grp), period_us(grp)) == (30_000, 100_000)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "per 100 ms period" in out and "undone" in out
    assert leftover_groups() == before
    r = run_cli("inject", "compute", "--pid", str(sleeper.pid), "--quota", "0.3",
                "--period-ms", "2000")
    assert r.returncode != 0 and "a CFS period is 1 ms to 1 s" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and leftover_groups() == before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_compute_undone_on_signal(sleeper, sig):
    before = leftover_groups()
    p = start_inject("compute", "--pid", str(sleeper.pid), "--quota", "0.3")
    wait_for(lambda: "greyhound-" in group_of(sleeper.pid), 20, "the quota")
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "undone" in out
    assert leftover_groups() == before


def test_undo_all_after_sigkill(sleeper):
    before = leftover_groups()
    p = start_inject("compute", "--pid", str(sleeper.pid), "--quota", "0.5")
    wait_for(lambda: "greyhound-" in group_of(sleeper.pid), 20, "the quota")
    p.kill()
    p.wait()
    assert len(leftover_groups()) == len(before) + 1          # SIGKILL leaves it
    r = run_cli("inject", "--undo-all")
    assert r.returncode == 0 and "undid cgroup" in r.stdout
    assert leftover_groups() == [] and "greyhound-" not in group_of(sleeper.pid)
    r = run_cli("inject", "--undo-all")
    assert "nothing to undo" in r.stdout


@pytest.fixture
def veth():
    name = f"gh{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "link", "add", f"{name}a", "type", "veth", "peer", "name",
                    f"{name}b"], check=True)
    subprocess.run(["ip", "link", "set", f"{name}a", "up"], check=True)
    yield f"{name}a"
    subprocess.run(["ip", "link", "del", f"{name}a"], check=False)


def root_qdisc(dev):
    return subprocess.run(["tc", "qdisc", "show", "dev", dev, "root"], capture_output=True,
                          text=True).stdout


def test_link_rate_applied_and_removed(veth):
    p = start_inject("link", "--dev", veth, "--rate", "400mbit", "--for", "2")
    wait_for(lambda: "tbf 6768:" in root_qdisc(veth), 20, "the tbf qdisc")
    assert "rate 400Mbit" in root_qdisc(veth)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "undone" in out
    assert "tbf" not in root_qdisc(veth)
    # SIGKILL leaves it; --undo-all removes it.
    p = start_inject("link", "--dev", veth, "--rate", "10mbit")
    wait_for(lambda: "tbf 6768:" in root_qdisc(veth), 20, "the tbf qdisc")
    p.kill()
    p.wait()
    assert "tbf" in root_qdisc(veth)
    r = run_cli("inject", "--undo-all")
    assert f"tbf on {veth}" in r.stdout and "tbf" not in root_qdisc(veth)


def test_link_refuses_a_configured_qdisc(veth):
    # Someone's own shaping (tbf under another handle: this kernel has few qdiscs).
    subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "handle", "1:", "tbf", "rate",
                    "1gbit", "burst", "64kb", "latency", "10ms"], check=True)
    r = run_cli("inject", "link", "--dev", veth, "--rate", "1mbit", "--for", "1")
    assert r.returncode == 2 and "already has a configured root qdisc" in r.stderr
    assert "tbf 1:" in root_qdisc(veth)


def test_bad_input_is_one_line():
    cases = [
        (("inject", "link", "--dev", "nonexistent0", "--rate", "1mbit"), 2, "no network interface"),
        (("inject", "link", "--dev", "lo", "--rate", "fast"), 2, "not a rate"),
        (("inject", "compute", "--pid", "999999999", "--quota", "0.5"), 2, "no process"),
        (("inject", "gpu-clock", "--gpu", "0", "--mhz", "900"), 1, "cannot lock GPU clocks"),
        (("inject",), 2, "name a fault"),
    ]
    for args, code, msg in cases:
        r = run_cli(*args)
        assert r.returncode == code and msg in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_parse_rate():
    assert parse_rate("400mbit") == 400_000_000 and parse_rate("1gbit") == 10**9
    assert parse_rate("64kbit") == 64_000


@pytest.fixture
def stand_in_nvml(tmp_path):
    """`inject` run with tests/stand_ins/pynvml.py (a stand-in: no GPU here)
    and a state directory of its own."""
    log = tmp_path / "nvml.log"
    env = dict(__import__("os").environ, GH_STAND_IN_NVML_LOG=str(log),
               GREYHOUND_STATE_DIR=str(tmp_path / "state"),
               PYTHONPATH=f"{ROOT / 'tests' / 'stand_ins'}:{ROOT}")
    return env, log


def _inject(env, *args, **kw):
    return subprocess.Popen([*GREYHOUND, "inject", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, **kw)


def test_gpu_clock_is_unlocked_and_nvml_shut_down(stand_in_nvml):
    env, log = stand_in_nvml
    out, _ = _inject(env, "gpu-clock", "--gpu", "1", "--mhz", "900", "--for", "0.5").communicate(
        timeout=60)
    assert "locked at 900 MHz for 0.5 s" in out and "undone" in out, out
    assert log.read_text().splitlines() == ["Init", "SetGpuLockedClocks 1 900 900",
                                            "ResetGpuLockedClocks 1", "Shutdown"]


def test_gpu_clock_left_by_kill_9_is_undone_from_its_state_file(stand_in_nvml):
    env, log = stand_in_nvml
    p = _inject(env, "gpu-clock", "--gpu", "1", "--mhz", "900", "--for", "0")
    wait_for(lambda: "SetGpuLockedClocks" in (log.read_text() if log.exists() else ""), 30,
             "the lock")
    p.kill()
    p.wait()
    # A second lock on that GPU is refused while the first one's state is there.
    again = _inject(env, "gpu-clock", "--gpu", "1", "--mhz", "700", "--for", "1")
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 2 and "already locked" in out, out
    out, _ = _inject(env, "--undo-all").communicate(timeout=60)
    assert "GPU 1 clocks reset" in out, out
    assert log.read_text().splitlines()[-2:] == ["ResetGpuLockedClocks 1", "Shutdown"]
    out, _ = _inject(env, "--undo-all").communicate(timeout=60)
    assert "nothing to undo" in out


def test_every_injection_has_a_limit():
    from greyhound_bpf.cli import INJECT_DEFAULT_S, build_parser
    for fault in (["compute", "--pid", "1", "--quota", "0.5"], ["link", "--dev", "lo",
                                                                 "--rate", "1mbit"],
                  ["gpu-clock", "--gpu", "0", "--mhz", "900"]):
        assert build_parser().parse_args(["inject", *fault]).seconds == INJECT_DEFAULT_S > 0


THREAD_CHURN = """
import threading, time
while True:
    threading.Thread(target=time.sleep, args=(0.002,)).start()
"""


def test_a_rank_starting_threads_all_the_time_is_released():
    """A training process starts threads all the time (DataLoader pin
    threads, autograd, gloo), and a new thread is born in its parent's group:
    one pass over the group's members can leave one behind. The quota is
    still undone, the group removed and the process back where it was."""
    from greyhound_bpf.inject import CpuQuota
    p = subprocess.Popen(["python3", "-c", THREAD_CHURN])
    try:
        home, before = group_of(p.pid), leftover_groups()
        for _ in range(200):
            with CpuQuota(p.pid, 0.5):
                assert "greyhound-" in group_of(p.pid)
            assert group_of(p.pid) == home and leftover_groups() == before
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
