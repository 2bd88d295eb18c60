"""A network testbed for real link faults: every rank of a gloo job in its
own network namespace, joined by veth pairs to one bridge (10.77.0.0/24).
The host side of rank i's link is `<prefix>h<i>`: a tbf qdisc there slows
that rank's link for real (this kernel has no netem)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import kill_tree, trainer_command


def ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


class NetBed:
    """`ranks` namespaces on 10.77.0.0/24 (`subnet`); the bridge has the
    host's address HOST (.254), where a test starts what every "node"
    reaches (the job's Redis)."""

    HOST = 254

    def __init__(self, ranks: int, prefix: str = "ght", subnet: str = "10.77.0"):
        self.n, self.p, self.subnet = ranks, prefix, subnet
        self.bridge = f"{prefix}br"
        self.procs: list[subprocess.Popen] = []

    def addr(self, i: int) -> str:
        """Namespace i's address (HOST: the bridge's, in the root namespace)."""
        return f"{self.subnet}.{i if i == self.HOST else i + 1}"

    def ns(self, i: int) -> str:
        return f"{self.p}ns{i}"

    def host_dev(self, i: int) -> str:
        return f"{self.p}h{i}"

    def __enter__(self) -> "NetBed":
        self.down()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("link", "set", self.bridge, "up")
        ip("addr", "add", f"{self.addr(self.HOST)}/24", "dev", self.bridge)
        for i in range(self.n):
            ip("netns", "add", self.ns(i))
            ip("link", "add", self.host_dev(i), "type", "veth", "peer", "name", "ghnet",
               "netns", self.ns(i))
            ip("link", "set", self.host_dev(i), "master", self.bridge)
            ip("link", "set", self.host_dev(i), "up")
            ip("-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", "ghnet")
            ip("-n", self.ns(i), "link", "set", "ghnet", "up")
            ip("-n", self.ns(i), "link", "set", "lo", "up")
        return self

    def start_ranks(self, truth: Path, *train_args: str, port: int = 29711,
                    trainer: str = "demo") -> list[int]:
        """A trainer (harness.TRAINERS), one rank per namespace (no launcher)."""
        for i in range(self.n):
            env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(self.n), LOCAL_RANK=str(i),
                       MASTER_ADDR=self.addr(0), MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="ghnet", OMP_NUM_THREADS="1")
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.ns(i), sys.executable,
                 *trainer_command(trainer, truth, *train_args)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        return [p.pid for p in self.procs]   # `ip netns exec` execs the program: same pid

    def start_torchrun(self, i: int, nproc: int, run_id: str, port: int, truth: Path,
                       *train_args: str, log: Path | None = None) -> subprocess.Popen:
        """Node i of a multi-node torchrun (c10d rendezvous on node 0's
        address: node 0 hosts the store, `is_host` said, since a namespace
        has no hostname that tells torchrun the endpoint is its own)."""
        env = dict(os.environ, GLOO_SOCKET_IFNAME="ghnet", OMP_NUM_THREADS="1")
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(i), str(Path(sys.executable).parent / "torchrun"),
             "--nnodes", str(self.n), "--node-rank", str(i), "--nproc-per-node", str(nproc),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addr(0)}:{port}",
             "--rdzv-id", run_id, "--local-addr", self.addr(i),
             "--rdzv-conf", f"is_host={int(i == 0)}",
             *trainer_command("demo", truth, *train_args)],
            env=env, stdout=open(log, "w") if log else subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p                             # `ip netns exec` execs: p.pid is torchrun's

    def down(self) -> None:
        for p in self.procs:
            kill_tree(p)                     # and its DataLoader workers
            p.wait()
        for i in range(self.n):
            ip("netns", "del", self.ns(i), check=False)
            ip("link", "del", self.host_dev(i), check=False)
        ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc) -> None:
        self.down()

    def leftovers(self) -> list[str]:
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        nss = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return ([ln for ln in out.splitlines() if f" {self.p}" in ln]
                + [ln for ln in nss.splitlines() if ln.startswith(self.p)])
