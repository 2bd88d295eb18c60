"""Which GPU a rank uses (greyhound_bpf/diagnosis/gpus.py), on recorded
answers: NVML's device lists of real node kinds (written out as data: no
GPU is lent to these tests), the CUDA_VISIBLE_DEVICES launchers and
container runtimes set, and the /dev/nvidiaN minors a rank holds open."""
import os

import pytest

from greyhound_bpf.diagnosis.gpus import Gpu, open_minors, place

# An 8-GPU node of one model, as NVML lists it (PCI order; minors as the
# driver numbers them, which need not follow the index).
H100 = [Gpu(i, f"GPU-{i:x}a1b2c3d-0000-4000-8000-00000000000{i}", m, "NVIDIA H100 80GB HBM3")
        for i, m in enumerate([0, 1, 2, 3, 7, 6, 5, 4])]
# A mixed node: CUDA's default order (fastest first) need not be PCI order.
MIXED = [Gpu(0, "GPU-aaaa0000-0000-4000-8000-000000000000", 0, "NVIDIA A10"),
         Gpu(1, "GPU-bbbb0000-0000-4000-8000-000000000000", 1, "NVIDIA H100 PCIe")]
# A GPU split by MIG: the instances carry their parent's minor.
MIG = [Gpu(0, "GPU-cccc0000-0000-4000-8000-000000000000", 0, "NVIDIA A100-SXM4-40GB"),
       Gpu(0, "MIG-1111aaaa-0000-5000-8000-000000000000", 0, "NVIDIA A100-SXM4-40GB"),
       Gpu(0, "MIG-2222bbbb-0000-5000-8000-000000000000", 0, "NVIDIA A100-SXM4-40GB")]


@pytest.mark.parametrize("env,local_rank,gpus,minors,same_ns,want,how", [
    # Slurm / torchrun with one GPU per rank: cuda:0 is the one named.
    ({"CUDA_VISIBLE_DEVICES": "5"}, 5, H100, set(), True, 5, "CUDA_VISIBLE_DEVICES=5"),
    # Every GPU visible: the local rank picks (torch.cuda.set_device(local_rank)).
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 6, H100, set(), True, 6, "local rank 6"),
    # ...unless the rank holds one of them open: that one.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 0, H100, {3}, True, 3, "it has open"),
    # UUIDs and unique prefixes, as Kubernetes device plugins set them.
    ({"CUDA_VISIBLE_DEVICES": H100[2].uuid}, 0, H100, set(), True, 2, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-4a1b,GPU-5a1b"}, 1, H100, set(), True, 5, "local rank 1"),
    # No environment, nothing open: the local rank over every GPU (one model).
    ({}, 7, H100, set(), True, 7, "local rank 7 over every GPU"),
    # A container's indices mean the container's GPUs: the open device tells
    # (minor 6 is NVML's GPU 5 on this node).
    ({"CUDA_VISIBLE_DEVICES": "0"}, 0, H100, {6}, False, 5, "/dev/nvidia6"),
    # A mixed node with an explicit PCI order is fine.
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, 1, MIXED, set(), True, 1, "local rank 1"),
    # MIG: the instance's id goes to the worker as it is.
    ({"CUDA_VISIBLE_DEVICES": "MIG-2222"}, 0, MIG, {0}, True, 2, "CUDA_VISIBLE_DEVICES"),
])
def test_placed(env, local_rank, gpus, minors, same_ns, want, how):
    p = place(env, local_rank, gpus, minors, same_ns)
    assert p.uuid == gpus[want].uuid, p
    assert how in p.how


@pytest.mark.parametrize("env,local_rank,gpus,minors,same_ns,why", [
    # The old rule put every rank without a local rank on GPU 0.
    ({}, None, H100, set(), True, "no local rank"),
    ({}, None, H100, {0, 1}, True, "2 GPUs open"),
    # Fastest-first order on a mixed node: an index or a local rank is no proof.
    ({}, 0, MIXED, set(), True, "several models"),
    ({"CUDA_VISIBLE_DEVICES": "1"}, 0, MIXED, set(), True, "another mount namespace"),
    # A container's index and nothing open.
    ({"CUDA_VISIBLE_DEVICES": "0"}, 0, H100, set(), False, "another mount namespace"),
    ({"CUDA_VISIBLE_DEVICES": ""}, 0, H100, set(), True, "hides every GPU"),
    ({"CUDA_VISIBLE_DEVICES": "9"}, 0, H100, set(), True, "does not have"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-"}, 0, H100, set(), True, "matches 8 GPUs"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, None, H100, set(), True, "names 2 GPUs"),
    ({}, 0, [], set(), True, "no GPU"),
])
def test_unknown_is_said_not_guessed(env, local_rank, gpus, minors, same_ns, why):
    p = place(env, local_rank, gpus, minors, same_ns)
    assert p.uuid is None and why in p.how, p


def test_cuda_stops_at_the_first_empty_entry():
    """CUDA reads CUDA_VISIBLE_DEVICES up to the first invalid entry."""
    p = place({"CUDA_VISIBLE_DEVICES": "3,,5"}, 0, H100, set())
    assert p.uuid == H100[3].uuid


def test_no_nvidia_device_open_here():
    assert open_minors(os.getpid()) == set()
    assert open_minors(2 ** 22 + 7) == set()          # no such process


def _stand_in_nvml(monkeypatch, tmp_path, busy_s: float):
    """tests/stand_ins/pynvml.py (a stand-in, named as such: no GPU here)."""
    import importlib.util
    from pathlib import Path
    monkeypatch.setenv("GH_STAND_IN_NVML_LOG", str(tmp_path / "nvml.log"))
    monkeypatch.setenv("GH_STAND_IN_NVML_BUSY_S", str(busy_s))
    spec = importlib.util.spec_from_file_location(
        "stand_in_pynvml", Path(__file__).parent / "stand_ins" / "pynvml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_pause_waits_for_queued_gpu_work(monkeypatch, tmp_path):
    from greyhound_bpf.diagnosis.gpus import wait_drained
    nvml = _stand_in_nvml(monkeypatch, tmp_path, busy_s=0.4)
    drained, waited = wait_drained([H100[0].uuid, H100[1].uuid], 2.0, nvml=nvml)
    assert drained and 0.35 < waited < 1.5, waited
    nvml = _stand_in_nvml(monkeypatch, tmp_path, busy_s=30)
    drained, waited = wait_drained([H100[0].uuid], 0.5, nvml=nvml)
    assert not drained and 0.5 <= waited < 1.5
    assert (tmp_path / "nvml.log").read_text().split().count("Shutdown") == 2
    assert wait_drained([], 2.0) == (True, 0.0)
