"""Return sites are probed by file and ELF address (greyhound_bpf/probe/
sites.py): a runtime code address of a live process taken back through its
mapping and the file's program headers must land on the symbol's address."""
import ctypes
import ctypes.util
import os
import subprocess

import pytest

from greyhound_bpf.probe.sites import (exported_functions, file_vaddr, maps_dev, runtime_addresses,
                                         site_location)


def test_a_libc_function_maps_back_to_its_symbol():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    runtime = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    where = site_location(os.getpid(), runtime)
    assert not isinstance(where, str), where
    host, vaddr = where
    assert host.startswith(f"/proc/{os.getpid()}/root/")
    nm = subprocess.run(["nm", "-D", "--defined-only", host], capture_output=True, text=True,
                        check=True).stdout
    symbols = {int(a, 16) for a, _, name in (line.split()[:3] for line in nm.splitlines()
                                             if len(line.split()) >= 3)
               if name.split("@")[0] == "getpid"}
    assert vaddr in symbols, (hex(vaddr), [hex(s) for s in symbols])


def test_addresses_outside_files_are_refused_with_a_reason():
    buf = ctypes.create_string_buffer(64)                     # heap: no file
    assert "not in an executable file mapping" in site_location(os.getpid(),
                                                                ctypes.addressof(buf))
    assert site_location(os.getpid(), 8) == "0x8 is not mapped"
    assert "cannot read its maps" in site_location(2 ** 22 + 12345, 0x1000)


def test_non_elf_and_out_of_segment_offsets(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"not an ELF" * 10)
    assert file_vaddr(str(junk), 0) is None
    assert file_vaddr(str(tmp_path / "missing"), 0) is None
    assert file_vaddr("/bin/true", 10 ** 12) is None


def test_a_symbol_address_maps_forward_to_where_the_process_runs_it():
    """runtime_addresses, the inverse of site_location: libc's getpid by its
    ELF address lands on ctypes' own pointer to it in this process."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    runtime = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    host, vaddr = site_location(os.getpid(), runtime)
    st = os.stat(host)
    dev = maps_dev(st.st_dev)
    assert runtime_addresses(os.getpid(), host, dev, st.st_ino, [vaddr, 10 ** 12]) == \
        {vaddr: runtime}
    assert runtime_addresses(os.getpid(), host, dev, st.st_ino + 1, [vaddr]) == {}


@pytest.mark.parametrize("family", ["nccl", "cudart", "gloo"])
def test_exported_functions_agree_with_bccs_scan_of_every_symbol(family):
    """The catalog's symbols, looked up in the real library's GNU hash table,
    are exactly those (at the same addresses) that bcc finds by scanning all
    of its symbols."""
    import re

    import torch
    from bcc import BPF
    from nvidia import cuda_runtime

    from conftest import nccl_lib
    from greyhound_bpf.probe.catalog import load_catalog
    path = {"nccl": nccl_lib(), "cudart": f"{cuda_runtime.__path__[0]}/lib/libcudart.so.12",
            "gloo": f"{os.path.dirname(torch.__file__)}/lib/libtorch_cpu.so"}[family]
    fam = load_catalog().families[family]
    wanted = {s for fn in fam.functions for s in fn.symbols} | set(fam.counters)
    pattern = "^(" + "|".join(re.escape(s) for s in sorted(wanted)) + ")$"
    scanned = {n.decode(): a for n, a in
               BPF.get_user_functions_and_addresses(path.encode(), pattern.encode())}
    assert len(scanned) >= 7
    assert exported_functions(path, wanted) == scanned


def test_a_file_without_a_gnu_hash_table_is_left_to_the_scan(tmp_path):
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF" * 10)
    assert exported_functions(str(junk), {"f"}) is None
    assert exported_functions(str(tmp_path / "missing.so"), {"f"}) is None
