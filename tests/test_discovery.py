"""Target discovery over real processes: the tree under a launcher, rank
identity from the environment, launchers told apart from ranks, and the
libraries each process really mapped."""
import ctypes  # noqa: F401
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import kill_tree, nccl_lib, wait_for
from greyhound_bpf.probe.catalog import load_catalog
from greyhound_bpf.probe.discovery import (Discovery, all_stats, descendants, job_roots,
                                           mapped_libraries, rank_identity, read_stat,
                                           widened_note)

CAT = load_catalog()

CHILD = textwrap.dedent("""
    import ctypes, sys, time
    if len(sys.argv) > 1:
        ctypes.CDLL(sys.argv[1])
    print("up", flush=True)
    time.sleep(60)
""")


def spawn(env=None, lib=None, argv0=None):
    cmd = [sys.executable, "-c", CHILD] + ([lib] if lib else [])
    p = subprocess.Popen(cmd, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "up"
    return p


@pytest.fixture
def procs():
    made = []
    yield made
    for p in made:
        p.kill()
        p.wait()


def test_read_stat_handles_odd_process_names(tmp_path):
    exe = tmp_path / "we ird) (name"
    os.symlink("/bin/sleep", exe)
    p = subprocess.Popen([str(exe), "30"])
    try:
        st = wait_for(lambda: read_stat(p.pid), 5, "stat")
        assert st.ppid == os.getpid()
        assert st.comm == "we ird) (name"[:15]
    finally:
        p.kill()
        p.wait()


def test_descendants_of_a_launcher_script():
    p = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        def kids():
            # A forked child is `bash` until it has exec'd `sleep`.
            tree = descendants([p.pid], all_stats())
            return tree if len(tree) == 3 and all(
                read_stat(c).comm == "sleep" for c in tree if c != p.pid) else None
        tree = wait_for(kids, 5, "two sleep children")
        assert p.pid in tree
    finally:
        subprocess.run(["pkill", "-P", str(p.pid)])
        p.wait()


@pytest.mark.parametrize("env,want", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_SIZE": "16"}, (5, 2, 16)),
    ({"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "32"}, (7, 3, 32)),
    ({"RANK": "not-a-number"}, (None, None, None)),
])
def test_rank_identity_from_environment(procs, env, want):
    clean = {k: "" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    p = spawn(env={**clean, **env})
    procs.append(p)
    assert rank_identity(p.pid) == want


def test_mapped_libraries_sees_the_real_libnccl(procs):
    p = spawn(lib=nccl_lib())
    procs.append(p)
    libs = mapped_libraries(p.pid, CAT)
    assert set(libs) == {"nccl"}
    m = libs["nccl"]
    assert os.path.samefile(m.path, nccl_lib())
    assert m.host_path == f"/proc/{p.pid}/root{m.path}"
    assert os.stat(m.host_path).st_ino == m.inode


def test_a_library_is_loaded_once_its_code_is_mapped(procs):
    """The dynamic loader maps a library read-only before its code: until
    an executable mapping is there, there is nothing to probe yet."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import ctypes, mmap, sys
        f = open(sys.argv[1], "rb")
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        print("mapped", flush=True)
        sys.stdin.readline()
        ctypes.CDLL(sys.argv[1])
        print("loaded", flush=True)
        sys.stdin.readline()
    """), nccl_lib()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline().strip() == "mapped"
    maps = open(f"/proc/{p.pid}/maps").read()
    assert "libnccl" in maps
    assert mapped_libraries(p.pid, CAT) == {}
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "loaded"
    assert set(mapped_libraries(p.pid, CAT)) == {"nccl"}


def test_discovery_finds_new_and_exited_targets(procs):
    bash = subprocess.Popen(["bash", "-c", "sleep 60"])
    procs.append(bash)
    d = Discovery([bash.pid, os.getpid() + 10**7], CAT)
    assert d.scan() == ([], [], [])
    assert not d.libraries_seen
    p = spawn(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, lib=nccl_lib())
    procs.append(p)
    d.roots.append(p.pid)
    new, exited, _ = d.scan()
    assert [(t.pid, t.rank, t.world_size) for t in new] == [(p.pid, 1, 2)]
    assert d.libraries_seen
    p.kill()
    p.wait()
    new, exited, _ = d.scan()
    assert new == [] and [t.pid for t in exited] == [p.pid]


FORKING = textwrap.dedent("""
    import ctypes, os, sys, time
    ctypes.CDLL(sys.argv[1])
    kids = [os.fork() for _ in range(2)]      # like DataLoader workers: same env, same maps
    if 0 in kids:
        time.sleep(60)
        os._exit(0)
    print(" ".join(map(str, kids)), flush=True)
    time.sleep(60)
""")


def test_a_ranks_forked_workers_are_its_subprocesses_not_ranks(procs):
    p = subprocess.Popen([sys.executable, "-c", FORKING, nccl_lib()], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, RANK="3", WORLD_SIZE="4"))
    try:
        _forked_workers(p, procs)
    finally:
        kill_tree(p)               # the workers too


def _forked_workers(p, procs):
    kids = {int(k) for k in p.stdout.readline().split()}
    assert len(kids) == 2
    d = Discovery([p.pid], CAT)
    new, _, _ = d.scan()
    assert [(t.pid, t.rank) for t in new] == [(p.pid, 3)]
    assert set(d.subprocesses) >= kids and set(d.subprocesses.values()) == {p.pid}
    assert {pid for pid, _ in d.new_subprocesses} == set(d.subprocesses)
    # A PID the user names is never a subprocess, whatever its parent maps
    # (this test process has libnccl loaded too, and no RANK either).
    ctypes.CDLL(nccl_lib())
    q = spawn(lib=nccl_lib())
    procs.append(q)
    new, _, _ = Discovery([q.pid], CAT).scan()
    assert [t.pid for t in new] == [q.pid]


# mp.spawn's shape (PyTorch's DDP tutorial): a script with no rank in its
# environment starts three "spawn" children in order, each told its rank as an
# argument; rank 1 has a forked DataLoader-style worker and a spawned one
# (DataLoader(multiprocessing_context="spawn")). Python's own spawn machinery,
# the same that torch.multiprocessing.spawn calls.
SPAWNING = textwrap.dedent("""
    import ctypes, multiprocessing as mp, os, sys, time

    def sleeper(lib):
        ctypes.CDLL(lib)
        time.sleep(60)

    def rank(i, lib, q):
        ctypes.CDLL(lib)
        workers = []
        if i == 1:
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            w = mp.get_context("spawn").Process(target=sleeper, args=(lib,))
            w.start()
            workers = [pid, w.pid]
        q.put((i, os.getpid(), workers))
        time.sleep(60)

    if __name__ == "__main__":
        lib = sys.argv[1]
        ctypes.CDLL(lib)                        # the script imports torch too
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=rank, args=(i, lib, q)) for i in range(3)]
        for p in ps:
            p.start()
        got = sorted(q.get() for _ in ps)
        time.sleep(1.0)                         # the spawned worker's library mapped
        print(" ".join(f"{i}:{pid}:{','.join(map(str, w))}" for i, pid, w in got), flush=True)
        time.sleep(60)
""")


def test_mp_spawn_children_are_ranks_in_start_order(tmp_path):
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING)
    p = subprocess.Popen([sys.executable, str(script), nccl_lib()], stdout=subprocess.PIPE,
                         text=True, env={k: v for k, v in os.environ.items()
                                         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    try:
        line = p.stdout.readline().split()
        assert len(line) == 3, line
        pid_of, workers = {}, []
        for item in line:
            i, pid, w = item.split(":")
            pid_of[int(i)] = int(pid)
            workers += [int(x) for x in w.split(",") if x]
        assert len(workers) == 2
        d = Discovery([p.pid], CAT)
        new, _, _ = d.scan()
        # The script is their launcher, not a rank; each child is the rank it
        # was told, once; rank 1's workers are its subprocesses.
        got = {t.pid: (t.rank, t.local_rank, t.world_size, t.rank_from) for t in new}
        assert got == {pid_of[i]: (i, i, 3, "spawn order") for i in range(3)}
        assert {w: d.subprocesses.get(w) for w in workers} == {w: pid_of[1] for w in workers}
        assert d.scan() == ([], [], [])
        # One rank named on its own still gets its place among its siblings.
        new, _, _ = Discovery([pid_of[2]], CAT).scan()
        assert [(t.pid, t.rank, t.world_size) for t in new] == [(pid_of[2], 2, 3)]
        # ... and attach widens it to its job, the script that spawned it;
        # rank 1's workers (forked, spawned) are no ranks of the script.
        assert job_roots([pid_of[2]]) == ([p.pid], [(pid_of[2], p.pid)])
        assert "one of the ranks mp.spawn started" in widened_note(pid_of[2], p.pid)
        assert job_roots(workers) == (workers, [])
    finally:
        kill_tree(p)


def test_launchers_are_told_by_the_program_not_a_substring(tmp_path):
    """A rank whose script is named after a launcher (DeepSpeed's examples
    ship train_deepspeed.py) is a rank; a `torchrun` script and `python -m
    torch.distributed.run` are launchers, whatever follows them."""
    pkg = tmp_path / "torch" / "distributed"          # first on the module path
    pkg.mkdir(parents=True)
    for f in (pkg.parent / "__init__.py", pkg / "__init__.py"):
        f.write_text("")
    for f in (pkg / "run.py", tmp_path / "torchrun", tmp_path / "train_deepspeed.py"):
        f.write_text(CHILD)
    cmds = {"rank": ["train_deepspeed.py"], "torchrun": ["torchrun"],
            "module": ["-u", "-m", "torch.distributed.run"]}
    procs = {name: subprocess.Popen([sys.executable, *argv, nccl_lib()], cwd=tmp_path,
                                    stdout=subprocess.PIPE, text=True,
                                    env=dict(os.environ, RANK="0", WORLD_SIZE="1",
                                             PYTHONPATH=str(tmp_path)))
             for name, argv in cmds.items()}
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "up"
        d = Discovery([p.pid for p in procs.values()], CAT)
        new, _, _ = d.scan()
        assert [t.pid for t in new] == [procs["rank"].pid]
        assert d.libraries_seen
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


LAUNCHING = textwrap.dedent("""
    import os, subprocess, sys
    child, lib = sys.argv[1], sys.argv[2]
    def start(env):
        p = subprocess.Popen([sys.executable, "-c", child, lib], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, **env))
        assert p.stdout.readline().strip() == "up"
        return p
    ranks = [start({"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": "3"}) for i in range(3)]
    alone = start({"RANK": "0", "WORLD_SIZE": "1"})
    print(" ".join(str(p.pid) for p in ranks + [alone]), flush=True)
    for p in ranks + [alone]:
        p.wait()
""")


@pytest.mark.parametrize("launcher_name", ["torchrun", "slurmstepd"])
def test_one_ranks_pid_names_its_job_under_a_launcher(tmp_path, launcher_name):
    """`attach <a rank's PID>`: the user means the job. A rank of a world of
    3 under a launcher (a script named as torchrun or Slurm's step daemon
    here) is widened to the launcher, whose discovery finds all three; a
    single-process job under it, a rank under a shell, and a PID named with
    its launcher are not."""
    (tmp_path / launcher_name).write_text(LAUNCHING)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    launcher = subprocess.Popen([sys.executable, str(tmp_path / launcher_name), CHILD,
                                 nccl_lib()],
                                cwd=tmp_path, stdout=subprocess.PIPE, text=True, env=env)
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} -c \"$CHILD\" {nccl_lib()}; :"],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(env, CHILD=CHILD, RANK="1", WORLD_SIZE="3"))
    try:
        *ranks, alone = map(int, launcher.stdout.readline().split())
        assert shell.stdout.readline().strip() == "up"
        under_shell = wait_for(lambda: next(iter(set(descendants([shell.pid], all_stats()))
                                                 - {shell.pid}), None), 5, "the shell's rank")
        roots, widened = job_roots([ranks[1]])
        assert (roots, widened) == ([launcher.pid], [(ranks[1], launcher.pid)])
        note = widened_note(ranks[1], launcher.pid)
        assert f"rank 1 of 3, under {launcher_name}" in note and "--only-named" in note
        new, _, _ = Discovery(roots, CAT).scan()
        assert sorted((t.rank, t.pid) for t in new) == sorted(
            [(0, ranks[0]), (1, ranks[1]), (2, ranks[2]), (0, alone)])
        assert job_roots([ranks[0], ranks[2]]) == ([launcher.pid],
                                                  [(ranks[0], launcher.pid),
                                                   (ranks[2], launcher.pid)])
        assert job_roots([alone]) == ([alone], [])
        assert job_roots([under_shell]) == ([under_shell], [])
        assert job_roots([launcher.pid, ranks[0]]) == ([launcher.pid], [])
        assert job_roots([999_999_999]) == ([999_999_999], [])
    finally:
        kill_tree(launcher)
        kill_tree(shell)
