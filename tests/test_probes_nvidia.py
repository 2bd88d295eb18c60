"""Uprobes on the real libnccl.so.2 and libcudart.so.12 from PyPI's NVIDIA
wheels. There is no GPU: every call fails, but its real entry point runs,
which is all a uprobe needs. Each call must be seen exactly once (never twice
through the pncclX alias), with the arguments and return code the target
passed and got."""
import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from conftest import TARGETS, wait_for

pytestmark = pytest.mark.bpf

CALL_FIELDS = ("count", "dtype", "op", "peer", "root", "comm", "stream", "nranks", "comm_rank",
               "memcpy_kind", "ret")


@pytest.fixture
def nvidia_target():
    p = subprocess.Popen([sys.executable, str(TARGETS / "nvidia_calls.py"), "5"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(p.stdout.readline())
    assert ready["ready"]
    p.gpu = ready["gpu"]          # the target makes safe calls on a GPU host too
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def run_calls(p) -> list[dict]:
    p.stdin.write("\n")
    p.stdin.flush()
    made = []
    for line in p.stdout:
        d = json.loads(line)
        if d.get("done"):
            break
        made.append(d)
    return made


def test_every_call_seen_once_with_exact_arguments(nvidia_target, tracer):
    t = tracer([nvidia_target.pid], "--calls", "-q")
    ranks = t.wait_attached(1)
    assert ranks[0]["pid"] == nvidia_target.pid
    assert set(ranks[0]["libraries"]) == {"nccl", "cudart"}
    attach = t.events("attach")[0]
    # 16 NCCL functions + 6 CUDA runtime functions, each once per address.
    assert attach["probes"] == 22
    made = run_calls(nvidia_target)
    nvidia_target.stdin.write("\n")
    nvidia_target.stdin.flush()
    assert t.wait(60) == 0, t.output()

    calls = t.events("call")
    assert [c["fn"] for c in calls] == [m["fn"] for m in made], "order or count differs"
    for seen, want in zip(calls, made):
        for f in CALL_FIELDS:
            if f in want:
                assert seen[f] == want[f], (want["fn"], f, seen)
        assert seen["pid"] == nvidia_target.pid and seen["tid"] > 0
        assert seen["dur_ns"] > 0
        assert seen["v"] == 1 and seen["job"]
    # The pncclX alias shares the address: a double attach would show 2x.
    counts = Counter(c["fn"] for c in calls)
    assert counts["ncclAllReduce"] == 5 and counts["cudaMemcpy"] == 5
    # The comm out-parameter is read at return: NULL after a failed init,
    # not the pointer value that was passed in.
    init = [c for c in calls if c["fn"] == "ncclCommInitRank"]
    assert len(init) == 1 and init[0]["rank"] is None
    if not nvidia_target.gpu:      # else one real rank (its fields checked above)
        assert (init[0]["comm"], init[0]["nranks"], init[0]["comm_rank"]) == (0, 4, 2)
    # bytes = count x dtype size for NCCL calls.
    ar = next(c for c in calls if c["fn"] == "ncclAllReduce")
    assert ar["bytes"] == ar["count"] * 4
    detach = t.events("detach")
    assert detach and detach[-1]["reason"] == "target_exited"
    assert detach[-1]["delivered"] == len(calls) and detach[-1]["lost"] == 0
    assert "ncclAllReduce" in t.output()          # the final text summary


def test_kernel_launches_are_counted_in_the_kernel(nvidia_target, tracer):
    t = tracer([nvidia_target.pid], "--calls", "--count-launches", "-q")
    t.wait_attached(1)
    made = run_calls(nvidia_target)
    nvidia_target.stdin.write("\n")
    nvidia_target.stdin.flush()
    assert t.wait(60) == 0, t.output()
    # One launch per round, counted per process; none is streamed as a call.
    assert t.events("detach")[-1]["launches"] == {str(nvidia_target.pid): 5}
    assert not [c for c in t.events("call") if c["fn"] == "cudaLaunchKernel"]
    assert len(t.events("call")) == len(made)
    assert "5 cudaLaunchKernel calls" in t.output()


def test_pncclx_alias_attached_once(nvidia_target, tracer):
    """Resolving the catalog yields both ncclX and pncclX at one address."""
    from bcc import BPF
    from conftest import nccl_lib
    found = BPF.get_user_functions_and_addresses(nccl_lib().encode(), b"^p?ncclAllReduce$")
    names = {n for n, _ in found}
    assert names == {b"ncclAllReduce", b"pncclAllReduce"}
    assert len({a for _, a in found}) == 1
    t = tracer([nvidia_target.pid], "-q")
    t.wait_attached(1)
    assert t.events("attach")[0]["functions"].count("ncclAllReduce") == 1
    t.stop()


def _fds_of(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]"
        except OSError:
            pass
    return n


def test_probes_of_an_exited_rank_are_released(tracer):
    """A rank that exits mid-trace gets its probes closed at once, not at the
    tracer's exit: an elastic job that restarts ranks must not leak fds."""
    targets = [subprocess.Popen([sys.executable, str(TARGETS / "nvidia_calls.py"), "1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        for p in targets:
            assert json.loads(p.stdout.readline())["ready"]
        t = tracer([p.pid for p in targets], "-q")
        t.wait_attached(2)
        wait_for(lambda: _fds_of(t.proc.pid) == 2 * 2 * 22, 10, "44 perf-event fds")
        targets[0].kill()
        targets[0].wait()
        wait_for(lambda: t.events("exit"), 10, "the exit event")
        assert t.events("exit")[0]["pid"] == targets[0].pid
        wait_for(lambda: _fds_of(t.proc.pid) == 2 * 22, 10, "the exited rank's fds to close")
        assert t.stop() == 0
    finally:
        for p in targets:
            p.kill()
            p.wait()


def test_entry_probes_find_their_function_by_address_and_forget_it_on_detach(nvidia_target):
    """The one entry program finds a call's function from the address its
    uprobe hit (`probe_fn`): one key per placed probe, inside the process's
    executable mapping of its library; every call made is then delivered
    (a wrong address would find no function and time nothing), and no key
    is left once the process is detached."""
    from greyhound_bpf.probe.catalog import load_catalog
    from greyhound_bpf.probe.discovery import Target, mapped_libraries
    from greyhound_bpf.probe.tracer import Tracer
    catalog = load_catalog()
    fds_before = _fds_of(os.getpid())
    libs = mapped_libraries(nvidia_target.pid, catalog)
    assert set(libs) == {"nccl", "cudart"}, libs
    t = Tracer(catalog)
    t.load()
    try:
        placed = t.attach(Target(nvidia_target.pid, 0, "python", None, None, None, libs))
        table = {(k.pid, k.addr): v.value for k, v in t.bpf[b"probe_fn"].items()}
        assert table == {(nvidia_target.pid, p.runtime): p.fn.fid for p in placed}
        assert len(placed) == 22, len(placed)
        # The runtime address is where the symbol is in the process's memory.
        maps = open(f"/proc/{nvidia_target.pid}/maps").read().splitlines()
        for p in placed:
            line = next(m for m in maps if int(m.split()[0].split("-")[0], 16) <= p.runtime
                        < int(m.split()[0].split("-")[1], 16))
            assert line.split()[-1].endswith(("libnccl.so.2", "libcudart.so.12")), line
            assert "x" in line.split()[1], line
        made = run_calls(nvidia_target)
        got = t.drain()
        assert len(got) == len(made), (len(got), len(made))
        t.detach(nvidia_target.pid)
        assert list(t.bpf[b"probe_fn"].items()) == []
        # The kernel takes the uprobes out in the background (detach does
        # not wait on them); close waits until every one is out.
    finally:
        t.close()
    assert t.to_remove() == 0
    assert _fds_of(os.getpid()) == fds_before


def test_a_few_calls_reach_the_stream_while_the_target_runs(nvidia_target, tracer):
    # Records are submitted without a wake-up except every 64th on a CPU
    # (probes/calls.bpf.c): a job making a few calls a second must still
    # reach the analysis within the poll interval, not when the 64th comes
    # (a job at a few iterations a second: seconds late, every rank's batch
    # behind the others').
    t = tracer([nvidia_target.pid], "--calls", "-q")
    t.wait_attached(1)
    made = run_calls(nvidia_target)
    assert len(made) < 64
    t0 = time.monotonic()
    seen = wait_for(lambda: len(t.events("call")) >= len(made), 3.0)
    assert seen, (f"{len(t.events('call'))} of {len(made)} calls streamed "
                  f"{time.monotonic() - t0:.1f} s after they were made, the target still running")
    nvidia_target.stdin.write("\n")
    nvidia_target.stdin.flush()
    assert t.wait(60) == 0, t.output()
    assert len(t.events("call")) == len(made)
