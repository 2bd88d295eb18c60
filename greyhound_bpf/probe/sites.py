"""Return sites: where a caller resumes after a probed call that may throw.

The BPF entry probe of such a function reports the caller's return address
as the process sees it (probes/greyhound.h). A uprobe is placed by file and
ELF virtual address (bcc turns that into a file offset through the program
headers), so the runtime address is taken back through the process's
mapping of the file and the PT_LOAD segment that holds it.
"""
from __future__ import annotations

import os
import struct
from functools import lru_cache

PT_LOAD = 1


@lru_cache(maxsize=64)
def _load_segments(path: str, dev_ino: tuple[int, int, int]) -> tuple[tuple[int, int, int], ...]:
    """(p_offset, p_vaddr, p_filesz) of each PT_LOAD of a 64-bit little-endian ELF."""
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return ()
        phoff, = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        if phentsize < 56 or phnum > 4096:
            return ()
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
    segs = []
    for i in range(len(table) // phentsize):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table,
                                                                     i * phentsize)
        if p_type == PT_LOAD:
            segs.append((p_offset, p_vaddr, p_filesz))
    return tuple(segs)


def file_vaddr(path: str, file_offset: int) -> int | None:
    """The ELF virtual address of a byte of the file, or None if no loaded
    segment holds it."""
    try:
        st = os.stat(path)
        segs = _load_segments(path, (st.st_dev, st.st_ino, st.st_mtime_ns))
    except OSError:
        return None
    for off, vaddr, size in segs:
        if off <= file_offset < off + size:
            return file_offset - off + vaddr
    return None


def site_location(pid: int, addr: int) -> tuple[str, int] | str:
    """(host path of the file, ELF virtual address) of a code address in a
    process, or why it cannot be probed."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            lines = fh.readlines()
    except OSError as e:
        return f"cannot read its maps ({e.strerror})"
    for line in lines:
        parts = line.split(None, 5)
        lo, _, hi = parts[0].partition("-")
        if not int(lo, 16) <= addr < int(hi, 16):
            continue
        path = parts[5].rstrip("\n") if len(parts) == 6 else ""
        if "x" not in parts[1] or not path.startswith("/"):
            return f"{addr:#x} is not in an executable file mapping ({path or 'anonymous'})"
        if path.endswith(" (deleted)"):
            host = f"/proc/{pid}/map_files/{parts[0]}"
        else:
            host = f"/proc/{pid}/root{path}"
        vaddr = file_vaddr(host, addr - int(lo, 16) + int(parts[2], 16))
        if vaddr is None:
            return f"{addr:#x} is in no loaded segment of {path}"
        return host, vaddr
    return f"{addr:#x} is not mapped"
