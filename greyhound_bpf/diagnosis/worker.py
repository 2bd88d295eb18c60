"""One validation worker: runs where a rank runs and benchmarks its device and
its links on the controller's command (`greyhound_bpf.diagnosis.validator`).

The controller starts it inside the rank's network namespace (nsenter),
moves it into the rank's cgroups and CPU affinity, and then talks to it in
JSON lines on stdin/stdout:

    <- {"port": P, "addr": A}              rank 0 only: its store listens on P; A is
                                           its address toward MASTER_ADDR (other hosts)
    -> {"cmd": "join", "addr": A, "port": P}
    <- {"ready": true, "device": "cpu"}
    -> {"cmd": "gemm", "seconds": 0.3}
    <- {"ms_per_gemm": ..., "gflops": ..., "gemms": ..., "nvml": {...}}
    -> {"cmd": "p2p", "peer": j, "bytes": B, "seconds": 0.2}
    <- {"rtt_ms": ..., "rtt_min_ms": ..., "lat_us": ..., "gbps": ...}
    -> {"cmd": "exit"}

Each reply is one line; an error is {"error": "..."}. The worker exits when
stdin closes, so a controller that dies takes its workers with it.

Environment: GH_VAL_RANK, GH_VAL_WORLD, GH_VAL_DEVICE ("cpu" or "cuda:N"),
GH_VAL_TIMEOUT_S; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as the rank's.

On a GPU the worker is PyTorch's (NCCL send/recv, CUDA GEMMs). On a CPU it
imports NumPy only: a GEMM through NumPy's BLAS, one thread, and p2p over
plain TCP sockets, what gloo's pairs are. Importing torch costs about 3 CPU
seconds per worker, beside a running job (the workers start while it runs:
4 of them took 29 s on a 2-core host, 2.3 s of it paused), NumPy 0.3. The
group forms as PyTorch's does: the first rank's worker listens where the
controller says (`port`), every other worker registers its own p2p port
there and gets everyone's back; the lower rank of a pair connects.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import time
from datetime import timedelta

GEMM_N = 512                 # square float32 matmul on a CPU: 268 MFLOP
GEMM_N_GPU = 4096            # on a GPU: 137 GFLOP, long enough to time
LATENCY_BYTES = 8
LATENCY_REPS = 20


def address_toward(host: str | None) -> str | None:
    """This namespace's source address on the route to `host` (a UDP
    connect sends nothing): where workers on other hosts reach our store."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def reply(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def nvml_evidence(device: str) -> dict:
    """Clocks, temperature and throttle reasons of a GPU, named as NVML
    takes it: a UUID (GPU-... or MIG-...) or an index; {} without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        h = (pynvml.nvmlDeviceGetHandleByUUID(device) if not device.isdigit()
             else pynvml.nvmlDeviceGetHandleByIndex(int(device)))
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))}
    except Exception as e:          # a field this driver does not report
        return {"error": str(e)}
    finally:
        pynvml.nvmlShutdown()


def nvml_device(cuda_index: int) -> str:
    """How NVML names CUDA's device `cuda_index`: the worker's
    CUDA_VISIBLE_DEVICES entry (a UUID, as validation sets it) or index."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return visible[cuda_index] if cuda_index < len(visible) else str(cuda_index)


def recv_exact(sock: socket.socket, buf) -> None:
    view, got = memoryview(buf), 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer's worker closed the connection")
        got += n


def recv_line(sock: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the peer's worker closed the connection")
        data += chunk
    return json.loads(data)


def cpu_gemm(size: int):
    """One GEMM of `size` on this CPU, one thread (the env sets it): NumPy's
    BLAS, or torch's where NumPy is missing (a job's own interpreter)."""
    try:
        import numpy as np
        rng = np.random.default_rng()
        a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
        c = np.empty_like(a)
        return lambda: np.matmul(a, b, out=c)
    except ImportError:
        import torch
        torch.set_num_threads(1)
        a, b = torch.randn(size, size), torch.randn(size, size)
        return lambda: torch.matmul(a, b)


class CpuWorker:
    """A CPU rank's worker: NumPy and sockets (see the module's docstring)."""

    def __init__(self) -> None:
        self.rank = int(os.environ["GH_VAL_RANK"])
        self.world = int(os.environ["GH_VAL_WORLD"])
        self.timeout = float(os.environ.get("GH_VAL_TIMEOUT_S", "20"))
        self.matmul = cpu_gemm(GEMM_N)
        self.listener = socket.create_server(("0.0.0.0", 0), backlog=self.world)
        self.listener.settimeout(self.timeout)
        self.peers: dict[int, tuple[str, int]] = {}
        self.conns: dict[int, socket.socket] = {}
        self.store = None
        if self.rank == 0:
            self.store = socket.create_server(("0.0.0.0", 0), backlog=self.world)
            reply({"port": self.store.getsockname()[1],
                   "addr": address_toward(os.environ.get("MASTER_ADDR"))})

    def join(self, addr: str, port: int) -> dict:
        mine = self.listener.getsockname()[1]
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            table, regs = {0: (None, mine)}, []
            while len(table) < self.world:
                self.store.settimeout(max(0.1, deadline - time.monotonic()))
                conn, (host, _) = self.store.accept()
                conn.settimeout(self.timeout)
                hello = recv_line(conn)
                table[int(hello["rank"])] = (host, int(hello["port"]))
                regs.append(conn)
            for conn in regs:
                conn.sendall((json.dumps(table) + "\n").encode())
                conn.close()
            self.store.close()
        else:
            while True:
                try:
                    conn = socket.create_connection((addr, port), timeout=self.timeout)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            with conn:
                conn.sendall((json.dumps({"rank": self.rank, "port": mine}) + "\n").encode())
                table = recv_line(conn)
        self.peers = {int(r): (host or addr, int(p)) for r, (host, p) in table.items()}
        return {"ready": True, "device": "cpu", "backend": "tcp"}

    def gemm(self, seconds: float) -> dict:
        for _ in range(2):                       # warm-up: pages, BLAS's buffers
            self.matmul()
        count, t0 = 0, time.perf_counter()
        while True:
            self.matmul()
            count += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        return {"ms_per_gemm": elapsed / count * 1e3,
                "gflops": 2 * GEMM_N ** 3 * count / elapsed / 1e9, "gemms": count}

    def _conn(self, peer: int) -> socket.socket:
        """The pair's connection: the lower rank connects, the higher
        accepts (another pair's early connection is kept for its turn)."""
        while peer not in self.conns:
            if self.rank < peer:
                conn = socket.create_connection(self.peers[peer], timeout=self.timeout)
                conn.sendall(struct.pack("!i", self.rank))
                who = peer
            else:
                conn, _ = self.listener.accept()
                conn.settimeout(self.timeout)
                head = bytearray(4)
                recv_exact(conn, head)
                who = struct.unpack("!i", head)[0]
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[who] = conn
        return self.conns[peer]

    @staticmethod
    def _pingpong(conn: socket.socket, buf, first: bool) -> float:
        t0 = time.perf_counter()
        if first:
            conn.sendall(buf)
            recv_exact(conn, buf)
        else:
            recv_exact(conn, buf)
            conn.sendall(buf)
        return time.perf_counter() - t0

    def p2p(self, peer: int, nbytes: int, seconds: float) -> dict:
        conn, first = self._conn(peer), self.rank < peer
        small, big, flag = bytearray(LATENCY_BYTES), bytearray(nbytes), bytearray(1)

        def tell(more: bool | None) -> bool:
            if first:
                conn.sendall(b"\1" if more else b"\0")
                return more
            recv_exact(conn, flag)
            return flag[0] == 1
        # Warm-up: the big buffer's pages and TCP's window opening too.
        return time_link(lambda buf: self._pingpong(conn, buf, first), tell, small, big,
                         nbytes, first, seconds, warm=(small, big))

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.listener.close()


def time_link(pingpong, tell, small, big, nbytes: int, first: bool, seconds: float,
              warm=()) -> dict:
    """One end of a link's measurement, either worker's transport:
    `pingpong(buf)` times one round trip, `tell(more)` sends the lower
    rank's "another round trip?" (`first`) or receives it (more=None). The
    lower rank decides how many both make, so both ends agree without a
    clock. `warm`: buffers sent once first, untimed (the small one at least:
    the connection's set-up)."""
    for buf in warm or (small,):
        pingpong(buf)
    lat = [pingpong(small) for _ in range(LATENCY_REPS)]
    rtts, t0 = [], time.perf_counter()
    while tell((len(rtts) < 3 or time.perf_counter() - t0 < seconds) if first else None):
        rtts.append(pingpong(big))
    rtt = low_round_trip(rtts)
    return {"rtt_ms": rtt * 1e3, "rtt_min_ms": min(rtts) * 1e3,
            "rtt_median_ms": statistics.median(rtts) * 1e3,
            "lat_us": min(lat) / 2 * 1e6,
            "gbps": 2 * nbytes * 8 / rtt / 1e9, "round_trips": len(rtts)}


def low_round_trip(rtts: list[float]) -> float:
    """The round trip a link is judged by: the 10th percentile (nearest
    rank; the fastest of fewer than ten). Noise (scheduling on a shared
    host, other traffic) mostly adds time, while a rate limit or a degraded
    link slows every round trip, these too. Not the single fastest: on this
    2-core VM one healthy edge's fastest of 47 read 1.10 ms where its
    median was 4.09 and the other healthy edges' fastest 2.3-3.4 ms (10
    readings of three runs), and against it the two edges of a healthy
    node read x2.79, a slow link (a clean-clone CI run, the three-node
    live test)."""
    return sorted(rtts)[len(rtts) // 10]


class Worker:
    """A GPU rank's worker: PyTorch, NCCL (gloo on a CPU: GH_VAL_WORKER=torch)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        self.rank = int(os.environ["GH_VAL_RANK"])
        self.world = int(os.environ["GH_VAL_WORLD"])
        self.timeout = float(os.environ.get("GH_VAL_TIMEOUT_S", "20"))
        dev = os.environ.get("GH_VAL_DEVICE", "cpu")
        self.device = torch.device(dev)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            torch.set_num_threads(1)      # one rank's share, like the rank's own threads
            self.backend = "gloo"
        self.store = None
        if self.rank == 0:
            self.store = dist.TCPStore("0.0.0.0", 0, self.world, is_master=True,
                                       timeout=timedelta(seconds=self.timeout),
                                       wait_for_workers=False)
            reply({"port": self.store.port,
                   "addr": address_toward(os.environ.get("MASTER_ADDR"))})

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def join(self, addr: str, port: int) -> dict:
        dist = self.dist
        if self.store is None:
            self.store = dist.TCPStore(addr, port, self.world, is_master=False,
                                       timeout=timedelta(seconds=self.timeout))
        dist.init_process_group(self.backend, store=self.store, rank=self.rank,
                                world_size=self.world,
                                timeout=timedelta(seconds=self.timeout))
        return {"ready": True, "device": str(self.device), "backend": self.backend}

    def gemm(self, seconds: float) -> dict:
        torch = self.torch
        size = GEMM_N_GPU if self.device.type == "cuda" else GEMM_N
        a = torch.randn(size, size, device=self.device)
        b = torch.randn(size, size, device=self.device)
        for _ in range(2):                       # warm-up: allocation, kernel choice
            torch.matmul(a, b)
        self.sync()
        count, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b)
            count += 1
            if count % 8 == 0 or self.device.type == "cpu":
                self.sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    break
        out = {"ms_per_gemm": elapsed / count * 1e3,
               "gflops": 2 * size ** 3 * count / elapsed / 1e9, "gemms": count}
        if self.device.type == "cuda":
            out["nvml"] = nvml_evidence(nvml_device(self.device.index or 0))
        return out

    def _pingpong(self, peer: int, buf, first: bool) -> float:
        dist = self.dist
        self.sync()
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        self.sync()
        return time.perf_counter() - t0

    def p2p(self, peer: int, nbytes: int, seconds: float) -> dict:
        torch = self.torch
        first = self.rank < peer
        small = torch.zeros(LATENCY_BYTES // 4, device=self.device)
        big = torch.zeros(nbytes // 4, device=self.device)

        def tell(more: bool | None) -> bool:
            flag = torch.ones(1, device=self.device)
            if first:
                flag.fill_(1.0 if more else 0.0)
                self.dist.send(flag, peer)
                return more
            self.dist.recv(flag, peer)
            return bool(flag.item())
        return time_link(lambda buf: self._pingpong(peer, buf, first), tell, small, big,
                         nbytes, first, seconds)

    def close(self) -> None:
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception:
            pass


def main() -> int:
    try:
        # GH_VAL_WORKER=torch: PyTorch's worker on a CPU too (scripts/bench_validate)
        cpu = (os.environ.get("GH_VAL_DEVICE", "cpu") == "cpu"
               and os.environ.get("GH_VAL_WORKER") != "torch")
        w = CpuWorker() if cpu else Worker()
    except Exception as e:
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd.get("cmd")
            if op == "exit":
                break
            if op == "join":
                reply(w.join(cmd["addr"], int(cmd["port"])))
            elif op == "gemm":
                reply(w.gemm(float(cmd.get("seconds", 0.3))))
            elif op == "p2p":
                reply(w.p2p(int(cmd["peer"]), int(cmd["bytes"]), float(cmd.get("seconds", 0.2))))
            else:
                reply({"error": f"unknown command {op!r}"})
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
