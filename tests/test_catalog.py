"""Probe catalogs: well-formed, and every symbol they name exists in the real
libraries this project tests on (PyPI's NVIDIA wheels and PyTorch)."""
import re
import subprocess
from pathlib import Path

import pytest

from greyhound_bpf.probe.catalog import CatalogError, load_catalog

CAT = load_catalog()

NCCL_FUNCTIONS = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Bcast", "Reduce",
                  "Send", "Recv", "GroupStart", "GroupEnd", "CommInitRank",
                  "CommInitRankConfig", "CommInitAll", "CommSplit", "CommDestroy", "CommAbort"}
CUDART_FUNCTIONS = {"StreamSynchronize", "DeviceSynchronize", "EventSynchronize",
                    "EventRecord", "Memcpy", "MemcpyAsync"}


def dynamic_symbols(path: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def lib(module: str, name: str) -> str:
    import importlib
    m = importlib.import_module(module)
    return str(Path(list(m.__path__)[0]) / "lib" / name)


def test_issue_functions_present():
    assert {f.name for f in CAT.families["nccl"].functions} == {f"nccl{n}" for n in NCCL_FUNCTIONS}
    assert {f.name for f in CAT.families["cudart"].functions} == {f"cuda{n}" for n in CUDART_FUNCTIONS}
    assert CAT.families["cudart"].counters == ("cudaLaunchKernel",)
    gloo = {f.name for f in CAT.families["gloo"].functions}
    assert {"gloo::allreduce", "gloo::allgather", "gloo::allgatherv", "gloo::broadcast",
            "gloo::barrier", "gloo::alltoall", "gloo::alltoallv", "gloo::gather",
            "gloo::scatter"} <= gloo


def test_function_ids_are_dense_and_unique():
    assert [f.fid for f in CAT.functions] == list(range(len(CAT.functions)))


def test_nccl_symbols_exist_in_real_libnccl():
    syms = dynamic_symbols(lib("nvidia.nccl", "libnccl.so.2"))
    for fn in CAT.families["nccl"].functions:
        assert fn.symbols[0] in syms, fn.name
        assert "p" + fn.symbols[0] in syms, f"p{fn.name}: the alias the tracer must not double-attach"


def test_cudart_symbols_exist_in_real_libcudart():
    syms = dynamic_symbols(lib("nvidia.cuda_runtime", "libcudart.so.12"))
    for fn in CAT.families["cudart"].functions:
        assert fn.symbols[0] in syms, fn.name
    assert "cudaLaunchKernel" in syms


def test_gloo_symbols_exist_in_libtorch_cpu():
    import torch
    syms = dynamic_symbols(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    found = {fn.name for fn in CAT.families["gloo"].functions if any(s in syms for s in fn.symbols)}
    # reduce_scatter is not a free function in PyTorch's gloo; the rest are.
    assert found >= {f.name for f in CAT.families["gloo"].functions} - {"gloo::reduce_scatter"}


def test_slot_layouts_follow_the_abi():
    by = CAT.by_name
    # 7th and 8th integer arguments come from the stack.
    assert by["ncclAllReduce"].args[5:] == ("comm", "stream")
    assert by["ncclReduce"].nargs == 8 and by["ncclReduce"].args[6:] == ("comm", "stream")
    # ncclUniqueId (128 bytes, by value) takes no register: rank is the 3rd slot.
    assert by["ncclCommInitRank"].args == ("comm", "nranks", "comm_rank")
    assert by["ncclCommInitRank"].deref == (0,)
    assert by["ncclCommSplit"].deref == (3,)


def test_family_matching():
    assert CAT.family_for("/usr/lib/x86_64-linux-gnu/libnccl.so.2").name == "nccl"
    assert CAT.family_for("/opt/x/libcudart.so.12.4.127").name == "cudart"
    assert CAT.family_for("/site/torch/lib/libtorch_cpu.so").name == "gloo"
    assert CAT.family_for("/usr/lib/libgloo.so.0").name == "gloo"
    assert CAT.family_for("/usr/lib/libc.so.6") is None


def test_decode_maps_enums_and_bytes():
    fn = CAT.by_name["ncclAllReduce"]
    slots = [0, 0, 1000, 7, 0, 0xABC, 0x5000, 0]
    d = CAT.decode(fn, slots, 4, 0)
    assert d == {"count": 1000, "dtype": "float32", "op": "sum", "comm": 0xABC,
                 "stream": 0x5000, "bytes": 4000, "ret": 4}
    # Unknown enum values stay numbers; int slots drop the garbage upper half.
    d = CAT.decode(fn, [0, 0, 1, (0xdead << 32) | 99, 42, 0, 0, 0], 0, 0)
    assert d["dtype"] == 99 and d["op"] == 42 and "bytes" not in d
    gloo = CAT.by_name["gloo::allreduce"]
    assert CAT.decode(gloo, [0, 0, 0, 0, 0, 0, 1000, 4], 12345, 0) == \
        {"count": 1000, "elem_size": 4, "bytes": 4000, "ret": None}
    # An implausible element size (another gloo layout) drops the numbers.
    assert CAT.decode(gloo, [0, 0, 0, 0, 0, 0, 1000, 3], 0, 0) == {"ret": None}
    assert CAT.decode(CAT.by_name["gloo::barrier"], [0] * 8, 7, 0) == {"ret": None}


def test_bad_catalog_is_rejected(tmp_path):
    (tmp_path / "x.toml").write_text(
        'family = "x"\nsoname = "libx.so"\n[[function]]\nname = "f"\nkind = "sync"\n'
        'args = ["cuont"]\n')
    with pytest.raises(CatalogError, match="unknown field 'cuont'"):
        load_catalog(tmp_path)
    (tmp_path / "x.toml").write_text('soname = "libx.so"\n')
    with pytest.raises(CatalogError, match="missing"):
        load_catalog(tmp_path)


def test_nccl_symbol_names_are_plain_identifiers():
    for fn in CAT.functions:
        for s in fn.symbols:
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", s), s
