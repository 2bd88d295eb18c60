"""Which physical GPU a rank uses, by UUID.

A rank's `cuda:N` means nothing outside it: N counts the devices its own
CUDA_VISIBLE_DEVICES lets it see (indices, `GPU-...` UUIDs or unique
prefixes of them, `MIG-...` ids), in CUDA's order; in a container those
indices are the container's. NVML numbers GPUs in PCI bus order and knows
each one's UUID and its /dev/nvidiaN minor number, which is the same inside
and outside a container. So a rank is placed by, in this order:

1. its CUDA_VISIBLE_DEVICES when it names one device, or names several and
   the rank's local rank picks one (the launchers' convention);
2. the /dev/nvidiaN it has open (``open_minors``) when the environment is
   silent or holds indices from another mount namespace (a container), and
   that narrows it to one;
3. its local rank over every GPU in PCI order when nothing else tells
   (CUDA's default order is "fastest first": the same as PCI order only on a
   node of one GPU model, so a mixed node with neither 1 nor 2 is unknown).

Anything else is unknown, said with the reason, and never guessed as GPU 0.
Validation workers then run with CUDA_VISIBLE_DEVICES=<UUID> and `cuda:0`,
whatever the rank's own view was.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

NVIDIA_MAJOR = 195          # /dev/nvidiaN; minor 255 is /dev/nvidiactl


@dataclass(frozen=True)
class Gpu:
    index: int              # NVML's (PCI bus order)
    uuid: str               # GPU-... (a MIG instance: MIG-...)
    minor: int              # /dev/nvidia<minor>; a MIG instance: its parent's
    name: str = ""


@dataclass(frozen=True)
class Placement:
    uuid: str | None        # None: unknown
    how: str                # the evidence, or why it is unknown


def nvml_gpus() -> list[Gpu]:
    """This machine's GPUs and MIG instances from NVML; [] without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name = _text(pynvml.nvmlDeviceGetUUID(h)), _text(pynvml.nvmlDeviceGetName(h))
            minor = int(pynvml.nvmlDeviceGetMinorNumber(h))
            out.append(Gpu(i, uuid, minor, name))
            try:
                mig_on = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except Exception:          # no MIG on this board or driver
                mig_on = False
            if mig_on:
                for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                    try:
                        m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                    except Exception:
                        continue
                    out.append(Gpu(i, _text(pynvml.nvmlDeviceGetUUID(m)), minor, name))
    except Exception:
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def open_minors(pid: int) -> set[int]:
    """Minor numbers of the /dev/nvidiaN devices a process has open."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR \
                and os.minor(st.st_rdev) < 255:
            found.add(os.minor(st.st_rdev))
    return found


def place(env: dict[str, str], local_rank: int | None, gpus: list[Gpu],
          minors: set[int], same_mount_ns: bool = True) -> Placement:
    """The GPU a rank uses (see the module's docstring for the rules)."""
    whole = [g for g in gpus if g.uuid.startswith("GPU-")] or gpus
    if not gpus:
        return Placement(None, "no GPU on this machine")
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible: list[Gpu] | None = None
    if cvd is not None:
        entries = [e.strip() for e in cvd.split(",")]
        entries = entries[:next((i for i, e in enumerate(entries) if not e), len(entries))]
        if not entries:
            return Placement(None, "CUDA_VISIBLE_DEVICES hides every GPU")
        if all(e.isdigit() for e in entries):
            if same_mount_ns and _pci_order(env, whole):
                visible = [next((g for g in whole if g.index == int(e)), None) for e in entries]
                if None in visible:
                    return Placement(None, f"CUDA_VISIBLE_DEVICES={cvd} names a GPU this "
                                           "machine does not have")
        else:
            visible = []
            for e in entries:
                match = [g for g in gpus if g.uuid.startswith(e)]
                if len(match) != 1:
                    return Placement(None, f"CUDA_VISIBLE_DEVICES entry {e!r} matches "
                                           f"{len(match)} GPUs")
                visible.append(match[0])
    if visible is not None:
        if len(visible) == 1:
            return Placement(visible[0].uuid, f"its CUDA_VISIBLE_DEVICES={cvd}")
        held = [g for g in visible if g.minor in minors and g.uuid.startswith("GPU-")]
        if len(held) == 1:
            return Placement(held[0].uuid, f"the one of CUDA_VISIBLE_DEVICES={cvd} it has open")
        if local_rank is not None and local_rank < len(visible):
            return Placement(visible[local_rank].uuid,
                             f"local rank {local_rank} of CUDA_VISIBLE_DEVICES={cvd}")
        return Placement(None, f"CUDA_VISIBLE_DEVICES={cvd} names {len(visible)} GPUs and "
                               "neither its open devices nor a local rank picks one")
    held = [g for g in whole if g.minor in minors]
    if len(held) == 1:
        return Placement(held[0].uuid, f"/dev/nvidia{held[0].minor}, the one GPU it has open")
    if cvd is not None:
        return Placement(None, f"CUDA_VISIBLE_DEVICES={cvd} holds indices of another mount "
                               f"namespace (a container), and it has {len(held)} GPUs open")
    if local_rank is not None and local_rank < len(whole) and _pci_order(env, whole):
        return Placement(whole[local_rank].uuid, f"local rank {local_rank} over every GPU")
    return Placement(None, f"no CUDA_VISIBLE_DEVICES, {len(held)} GPUs open, and "
                           + ("no local rank" if local_rank is None else
                              "GPUs of several models (CUDA orders them fastest first)"))


def _pci_order(env: dict[str, str], whole: list[Gpu]) -> bool:
    """Whether CUDA's indices follow NVML's (PCI bus) order."""
    return env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or len({g.name for g in whole}) <= 1


# After SIGSTOP the ranks' queued GPU work still runs (NCCL kernels spin on
# stopped peers). Validation waits this long at most for it to drain.
DRAIN_MAX_S = 2.0
IDLE_PCT = 5


def wait_drained(uuids: list[str], timeout_s: float = DRAIN_MAX_S, nvml=None,
                 poll_s: float = 0.05) -> tuple[bool, float]:
    """Once the ranks are stopped: wait until their GPUs run none of the
    job's queued work (NVML utilization under IDLE_PCT%: the share of its
    last sample period in which a kernel ran), at most `timeout_s`.
    Returns (drained, seconds waited); (True, 0) without NVML or GPUs."""
    if not uuids:
        return True, 0.0
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return True, 0.0
    try:
        nvml.nvmlInit()
    except Exception:
        return True, 0.0
    t0 = time.monotonic()
    try:
        handles = [nvml.nvmlDeviceGetHandleByUUID(u) for u in uuids]
        while True:
            busy = [nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
            waited = time.monotonic() - t0
            if max(busy) < IDLE_PCT:
                return True, waited
            if waited >= timeout_s:
                return False, waited
            time.sleep(poll_s)
    except Exception:
        return True, time.monotonic() - t0      # a GPU NVML cannot read: not waited on
    finally:
        nvml.nvmlShutdown()
