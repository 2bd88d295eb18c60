"""A STAND-IN for NVIDIA's pynvml (nvidia-ml-py), named as such: NVML needs
an NVIDIA driver and GPU, which these machines do not have. Only
tests/test_inject.py's GPU-clock tests put it first on PYTHONPATH, to check
what `inject gpu-clock` asks of NVML, and that `inject --undo-all` undoes it
after a kill -9, and tests/test_gpus.py's wait for queued GPU work to drain.
It records every call, one line each, in $GH_STAND_IN_NVML_LOG, has
$GH_STAND_IN_NVML_GPUS GPUs (default 2), and reports them 100% busy for
$GH_STAND_IN_NVML_BUSY_S seconds after nvmlInit (default 0)."""
import os
import time
from types import SimpleNamespace

_init_at = [0.0]


class NVMLError(Exception):
    pass


def _log(*words) -> None:
    with open(os.environ["GH_STAND_IN_NVML_LOG"], "a") as fh:
        fh.write(" ".join(map(str, words)) + "\n")


def nvmlInit():
    _init_at[0] = time.monotonic()
    _log("Init")


def nvmlShutdown():
    _log("Shutdown")


def nvmlDeviceGetCount():
    return int(os.environ.get("GH_STAND_IN_NVML_GPUS", "2"))


def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < nvmlDeviceGetCount():
        raise NVMLError("Invalid Argument")
    return ("gpu", i)


def nvmlDeviceSetGpuLockedClocks(h, lo, hi):
    _log("SetGpuLockedClocks", h[1], lo, hi)


def nvmlDeviceResetGpuLockedClocks(h):
    _log("ResetGpuLockedClocks", h[1])


def nvmlDeviceGetHandleByUUID(uuid):
    return ("gpu", uuid)


def nvmlDeviceGetUtilizationRates(h):
    busy = time.monotonic() - _init_at[0] < float(os.environ.get("GH_STAND_IN_NVML_BUSY_S", "0"))
    return SimpleNamespace(gpu=100 if busy else 0, memory=0)
