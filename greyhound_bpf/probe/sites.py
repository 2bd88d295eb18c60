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


def _segments(path: str) -> tuple[tuple[int, int, int], ...]:
    """The file's PT_LOAD segments, read once per version of the file."""
    try:
        st = os.stat(path)
        return _load_segments(path, (st.st_dev, st.st_ino, st.st_mtime_ns))
    except OSError:
        return ()


def file_vaddr(path: str, file_offset: int) -> int | None:
    """The ELF virtual address of a byte of the file, or None if no loaded
    segment holds it."""
    for off, vaddr, size in _segments(path):
        if off <= file_offset < off + size:
            return file_offset - off + vaddr
    return None


def vaddr_offset(path: str, vaddr: int) -> int | None:
    """The file offset of an ELF virtual address (file_vaddr's inverse), or
    None if no loaded segment holds it."""
    for off, va, size in _segments(path):
        if va <= vaddr < va + size:
            return vaddr - va + off
    return None


_FUNCTION_TYPES = {"STT_FUNC", "STT_GNU_IFUNC", "STT_LOOS"}   # pyelftools names IFUNC STT_LOOS


def exported_functions(path: str, names: set[str]) -> dict[str, int] | None:
    """ELF virtual address of each of `names` that the file exports as a
    function, looked up in its GNU hash table; None if it has none (then
    bcc's scan of every symbol does it)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    try:
        with open(path, "rb") as fh:
            table = ELFFile(fh).get_section_by_name(".gnu.hash")
            if table is None:
                return None
            found = {}
            for name in names:
                sym = table.get_symbol(name)
                if (sym is not None and sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]
                        and sym["st_info"]["type"] in _FUNCTION_TYPES):
                    found[name] = sym["st_value"]
            return found
    except (OSError, ELFError):
        return None


def maps_dev(st_dev: int) -> str:
    """A device number as /proc/PID/maps writes it."""
    return f"{os.major(st_dev):02x}:{os.minor(st_dev):02x}"


def runtime_addresses(pid: int, host_path: str, dev: str, inode: int,
                      vaddrs: list[int]) -> dict[int, int]:
    """ELF virtual address -> the address the process runs it at, for those
    of `vaddrs` in an executable mapping of the file (dev and inode as
    /proc/PID/maps gives them): where a uprobe placed by that address hits."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            maps = [line.split(None, 5) for line in fh]
    except OSError:
        return {}
    spans = []
    for parts in maps:
        if len(parts) >= 5 and "x" in parts[1] and parts[3] == dev and int(parts[4]) == inode:
            lo, _, hi = parts[0].partition("-")
            spans.append((int(lo, 16), int(hi, 16), int(parts[2], 16)))
    segs = _segments(host_path)
    out = {}
    for v in vaddrs:
        # The file offset, as bcc finds it to place a uprobe by address.
        off = next((v - sv + so for so, sv, size in segs if sv <= v < sv + size), None)
        for lo, hi, pgoff in spans:
            if off is not None and pgoff <= off < pgoff + hi - lo:
                out[v] = lo + off - pgoff
                break
    return out


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
