"""Return sites are probed by file and ELF address (greyhound_bpf/probe/
sites.py): a runtime code address of a live process taken back through its
mapping and the file's program headers must land on the symbol's address."""
import ctypes
import ctypes.util
import os
import subprocess

from greyhound_bpf.probe.sites import file_vaddr, site_location


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
