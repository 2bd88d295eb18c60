"""Test target: calls the real libnccl.so.2 and libcudart.so.12 through ctypes.

Without a GPU every call fails, but the real entry point runs, which is what
the uprobes see. On a GPU host the same calls must be safe too: streams are
real ones (a made-up handle is undefined behaviour there), the NCCL calls
keep a NULL communicator (refused before any use), and the communicator is
initialised with one rank and a real unique id (four ranks of an all-zero
id would wait for peers that never come), then destroyed. The script waits for a line on stdin (so the tracer can
attach first), makes the calls, prints one JSON line per call with the
arguments passed and the code returned, and waits for another line to exit.
"""
import ctypes as ct
import json
import sys

from nvidia import cuda_runtime, nccl

NCCL = ct.CDLL(f"{nccl.__path__[0]}/lib/libnccl.so.2")
CUDART = ct.CDLL(f"{cuda_runtime.__path__[0]}/lib/libcudart.so.12")
V = ct.c_void_p


class Dim3(ct.Structure):
    _fields_ = [("x", ct.c_uint), ("y", ct.c_uint), ("z", ct.c_uint)]


class NcclUniqueId(ct.Structure):
    # Passed by value, in memory: 128 bytes take no argument register.
    _fields_ = [("internal", ct.c_char * 128)]


def call(lib, fn, argtypes, *args, **expect):
    f = getattr(lib, fn)
    f.argtypes, f.restype = argtypes, ct.c_int
    ret = f(*args)
    print(json.dumps({"fn": fn, "ret": ret, **expect}), flush=True)


def gpu_present() -> bool:
    n = ct.c_int(0)
    CUDART.cudaGetDeviceCount.argtypes = [ct.POINTER(ct.c_int)]
    return CUDART.cudaGetDeviceCount(ct.byref(n)) == 0 and n.value > 0


def stream(fake: int, gpu: bool) -> int:
    """A real stream on a GPU host; without one, a distinctive made-up
    handle (the runtime fails before it looks at it)."""
    if not gpu:
        return fake
    s = V(0)
    CUDART.cudaStreamCreate.argtypes = [ct.POINTER(V)]
    assert CUDART.cudaStreamCreate(ct.byref(s)) == 0
    return s.value


def calls(rounds: int, gpu: bool) -> None:
    comm_out = ct.c_void_p(0)
    unique_id = NcclUniqueId()
    for i in range(rounds):
        # NULL comm: NCCL validates and returns ncclInvalidArgument (4). A
        # made-up comm pointer would be dereferenced and crash the process.
        call(NCCL, "ncclAllReduce", [V, V, ct.c_size_t, ct.c_int, ct.c_int, V, V],
             None, None, 1000 + i, 7, 0, None, V(0x5000 + i),
             count=1000 + i, dtype="float32", op="sum", comm=0, stream=0x5000 + i)
        call(NCCL, "ncclSend", [V, ct.c_size_t, ct.c_int, ct.c_int, V, V],
             None, 4096 + i, 9, 3, None, V(0x6000),
             count=4096 + i, dtype="bfloat16", peer=3, comm=0, stream=0x6000)
        call(NCCL, "ncclBroadcast", [V, V, ct.c_size_t, ct.c_int, ct.c_int, V, V],
             None, None, 77, 2, 1, None, V(0x7000),
             count=77, dtype="int32", root=1, comm=0, stream=0x7000)
        call(NCCL, "ncclReduce", [V, V, ct.c_size_t, ct.c_int, ct.c_int, ct.c_int, V, V],
             None, None, 55, 8, 2, 3, None, V(0x8000),
             count=55, dtype="float64", op="max", root=3, comm=0, stream=0x8000)
        h = stream(0x9000 + i, gpu)
        call(CUDART, "cudaStreamSynchronize", [V], V(h), stream=h)
        call(CUDART, "cudaMemcpy", [V, V, ct.c_size_t, ct.c_int],
             None, None, 2048, 2, count=2048, memcpy_kind="DeviceToHost")
        # Counted in the kernel with --count-launches, never streamed.
        launch = CUDART.cudaLaunchKernel
        launch.argtypes = [V, Dim3, Dim3, V, ct.c_size_t, V]
        launch.restype = ct.c_int
        launch(None, Dim3(1, 1, 1), Dim3(32, 1, 1), None, 0, None)
    if not gpu:
        # nranks=4, rank=2; comm stays NULL because init fails without a GPU.
        call(NCCL, "ncclCommInitRank", [ct.POINTER(V), ct.c_int, NcclUniqueId, ct.c_int],
             ct.byref(comm_out), 4, unique_id, 2, nranks=4, comm_rank=2, comm=0)
        return
    NCCL.ncclGetUniqueId.argtypes = [ct.POINTER(NcclUniqueId)]
    assert NCCL.ncclGetUniqueId(ct.byref(unique_id)) == 0
    f = NCCL.ncclCommInitRank
    f.argtypes, f.restype = [ct.POINTER(V), ct.c_int, NcclUniqueId, ct.c_int], ct.c_int
    ret = f(ct.byref(comm_out), 1, unique_id, 0)
    print(json.dumps({"fn": "ncclCommInitRank", "ret": ret, "nranks": 1, "comm_rank": 0,
                      "comm": comm_out.value or 0}), flush=True)
    if comm_out.value:
        NCCL.ncclCommDestroy.argtypes = [V]
        NCCL.ncclCommDestroy(comm_out)


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    gpu = gpu_present()
    print(json.dumps({"ready": True, "gpu": gpu}), flush=True)
    sys.stdin.readline()
    calls(rounds, gpu)
    print(json.dumps({"done": True}), flush=True)
    sys.stdin.readline()
