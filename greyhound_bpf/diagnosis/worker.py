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
    <- {"rtt_ms": ..., "lat_us": ..., "gbps": ...}
    -> {"cmd": "exit"}

Each reply is one line; an error is {"error": "..."}. The worker exits when
stdin closes, so a controller that dies takes its workers with it.

Environment: GH_VAL_RANK, GH_VAL_WORLD, GH_VAL_DEVICE ("cpu" or "cuda:N"),
GH_VAL_TIMEOUT_S; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as the rank's.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
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


class Worker:
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
        self._pingpong(peer, small, first)        # connection set-up, warm-up
        lat = [self._pingpong(peer, small, first) for _ in range(LATENCY_REPS)]
        # The lower rank decides how many round trips both make: it sends the
        # count first, so both ends agree without a clock.
        rtts, t0 = [], time.perf_counter()
        while True:
            flag = torch.ones(1, device=self.device)
            if first:
                more = len(rtts) < 3 or time.perf_counter() - t0 < seconds
                flag.fill_(1.0 if more else 0.0)
                self.dist.send(flag, peer)
            else:
                self.dist.recv(flag, peer)
                more = bool(flag.item())
            if not more:
                break
            rtts.append(self._pingpong(peer, big, first))
        # The fastest round trip: the link's capacity. Noise (scheduling on
        # a shared host, other traffic) only ever adds time, while a rate
        # limit or a degraded link slows every round trip, the fastest too.
        rtt = min(rtts)
        return {"rtt_ms": rtt * 1e3, "rtt_median_ms": statistics.median(rtts) * 1e3,
                "lat_us": min(lat) / 2 * 1e6,
                "gbps": 2 * nbytes * 8 / rtt / 1e9, "round_trips": len(rtts)}


def main() -> int:
    try:
        w = Worker()
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
    try:
        if w.dist.is_initialized():
            w.dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
