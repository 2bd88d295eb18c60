"""The BPF side of the tracer: load probes/calls.bpf.c, attach uprobes to the
libraries each target maps, and drain the ring buffer into NumPy records.

One uprobe and one uretprobe per (process, function address); a function
that may throw gets a uprobe at each return site its callers use instead of
the uretprobe (probes/greyhound.h), placed as the entry probe reports them.
Symbols are resolved once per library file (libtorch_cpu's symbol table
takes ~0.5 s to scan) and aliases at one address (ncclX / pncclX) are
attached once.
"""
from __future__ import annotations

import ctypes as ct
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from .. import GreyhoundError
from .catalog import Catalog, FunctionSpec, probes_dir
from .discovery import MappedLib, Target
from .records import (CALL_DTYPE, GH_F_NEW_SITE, GH_SITE_PROBED, GH_SITE_UNPROBEABLE,
                      GH_SPEC_RETURN_SITE, GhFnSpec)
from .sites import site_location

SITE_SWEEP_S = 1.0   # return sites are looked for this often even without a wake-up record
DEFAULT_RINGBUF_PAGES = 256   # 1 MiB: ~10k records, ~0.2 s of a busy 8-GPU node at VM probe cost


def import_bcc():
    try:
        import bcc  # Debian's python3-bpfcc; not on PyPI
    except ImportError as e:
        raise GreyhoundError(
            f"cannot import bcc ({e}); install python3-bpfcc and use a venv made with "
            "--system-site-packages (scripts/setup does both); see `greyhound-trace check`",
            exit_code=1) from None
    return bcc


@dataclass(frozen=True)
class Probe:
    """One attached function in one process."""
    pid: int
    fn: FunctionSpec
    path: str       # host path of the library
    addr: int       # symbol address as bcc takes it
    symbol: str


class Tracer:
    def __init__(self, catalog: Catalog, ringbuf_pages: int = DEFAULT_RINGBUF_PAGES,
                 count_launches: bool = False):
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise GreyhoundError(f"--ringbuf-pages must be a power of two, not {ringbuf_pages}")
        self.catalog = catalog
        self.ringbuf_pages = ringbuf_pages
        self.count_launches = count_launches
        self.bpf = None
        self.probes: dict[int, list[Probe]] = {}
        # bcc event names per pid: detaching by name needs no symbol lookup,
        # which fails once the process (and its /proc/PID/root) is gone.
        self._events: dict[int, list[bytes]] = {}
        self._symcache: dict[tuple, dict[str, int]] = {}
        self._chunks: list[bytes] = []
        self.delivered = 0
        # Return sites probed, per pid with a return-site function: runtime
        # address -> function id.
        self._sites: dict[int, dict[int, int]] = {}
        # (pid, function name) -> why a return site could not be probed: its
        # calls from there go untimed. Read and cleared by the caller.
        self.site_problems: dict[tuple[int, str], str] = {}
        self._sites_looked = 0.0

    # -- loading -----------------------------------------------------------

    def cflags(self) -> list[str]:
        # A record takes its size plus an 8-byte ring header.
        capacity = self.ringbuf_pages * 4096 // (CALL_DTYPE.itemsize + 8)
        wakeup_every = max(1, min(64, capacity // 4))
        retprobes = sum(1 << fn.fid for fn in self.catalog.functions if not fn.return_site)
        return [f"-I{probes_dir()}", f"-DGH_RINGBUF_PAGES={self.ringbuf_pages}",
                f"-DGH_WAKEUP_EVERY={wakeup_every}",
                f"-DGH_NFUNCS={len(self.catalog.functions)}",
                f"-DGH_RETPROBES={retprobes:#x}ULL"]

    def source_path(self) -> str:
        return str(probes_dir() / "calls.bpf.c")

    def load(self) -> None:
        bcc = import_bcc()
        try:
            self.bpf = bcc.BPF(src_file=self.source_path().encode(), cflags=self.cflags())
        except Exception as e:
            raise GreyhoundError(f"BPF program failed to load ({e}); run `greyhound-trace check`",
                                 exit_code=1) from None
        spec_table = self.bpf["fn_spec"]
        for fn in self.catalog.functions:
            spec = GhFnSpec(nargs=fn.nargs, deref_mask=fn.deref_mask,
                            field_slot=fn.field_slot, nfields=len(fn.fields),
                            flags=GH_SPEC_RETURN_SITE if fn.return_site else 0)
            for j, (_, off) in enumerate(fn.fields):
                spec.field_off[j] = off
            spec_table[ct.c_int(fn.fid)] = spec
        self.bpf["events"].open_ring_buffer(self._on_record)

    def _on_record(self, ctx, data, size):
        self._chunks.append(ct.string_at(data, size))
        return 0

    # -- attaching ---------------------------------------------------------

    def resolve(self, lib: MappedLib) -> dict[str, int]:
        """Symbol name -> address for every catalog symbol the library exports."""
        try:
            st = os.stat(lib.host_path)
        except OSError as e:
            raise GreyhoundError(f"cannot open {lib.host_path}: {e.strerror}") from None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key not in self._symcache:
            from bcc import BPF
            fam = self.catalog.families[lib.family]
            wanted = {s for fn in fam.functions for s in fn.symbols} | set(fam.counters)
            pattern = "^(" + "|".join(re.escape(s) for s in sorted(wanted)) + ")$"
            found = BPF.get_user_functions_and_addresses(lib.host_path.encode(), pattern.encode())
            self._symcache[key] = {name.decode(): addr for name, addr in found}
        return self._symcache[key]

    def attach(self, target: Target, families: list[str] | None = None) -> list[Probe]:
        """Attach every catalog function of the target's libraries; returns the
        probes placed. Aliases at one address are attached once."""
        placed: list[Probe] = []
        for fam_name, lib in sorted(target.libraries.items()):
            if families is not None and fam_name not in families:
                continue
            symbols = self.resolve(lib)
            fam = self.catalog.families[fam_name]
            seen_addrs: set[int] = set()
            for fn in fam.functions:
                sym = next((s for s in fn.symbols if s in symbols), None)
                if sym is None or symbols[sym] in seen_addrs:
                    continue
                addr = symbols[sym]
                seen_addrs.add(addr)
                probe = Probe(target.pid, fn, lib.host_path, addr, sym)
                try:
                    self._attach_one(probe)
                except Exception as e:
                    self._detach_events(target.pid)
                    if not os.path.exists(f"/proc/{target.pid}"):
                        return []
                    raise GreyhoundError(f"attaching {fn.name} in pid {target.pid} failed: {e}",
                                         exit_code=1) from None
                placed.append(probe)
            if self.count_launches:
                for c in fam.counters:
                    if c in symbols:
                        self._attach_raw(target.pid, lib.host_path, symbols[c],
                                         "gh_count_launch", retprobe=False)
        self.probes.setdefault(target.pid, []).extend(placed)
        if any(p.fn.return_site for p in placed):
            self._sites.setdefault(target.pid, {})
        return placed

    def _attach_one(self, p: Probe) -> None:
        self._attach_raw(p.pid, p.path, p.addr, f"gh_enter_{p.fn.fid}", retprobe=False)
        if p.fn.return_site:
            return
        try:
            self._attach_raw(p.pid, p.path, p.addr, f"gh_return_{p.fn.fid}", retprobe=True)
        except Exception:
            self._detach_events(p.pid)
            raise

    def place_sites(self) -> int:
        """Probe the return sites that entry probes reported since the last
        call; returns how many were placed. A call is timed from its site's
        probe on, the call that reported it included if it is still running."""
        placed = 0
        self._sites_looked = time.monotonic()
        table = self.bpf["sites"]
        for key, _ in table.items():
            pid, addr = key.pid, key.addr
            done = self._sites.get(pid)
            if done is None or addr in done:
                continue
            done[addr] = key.fn
            where = site_location(pid, addr)
            if not isinstance(where, str):
                try:
                    self._attach_raw(pid, where[0], where[1], "gh_site", retprobe=False)
                except Exception as e:
                    where = f"a uprobe at {addr:#x} failed: {e}"
            if isinstance(where, str):
                if os.path.exists(f"/proc/{pid}"):
                    self.site_problems[(pid, self.catalog.functions[key.fn].name)] = where
                table[key] = ct.c_uint8(GH_SITE_UNPROBEABLE)
            else:
                table[key] = ct.c_uint8(GH_SITE_PROBED)
                placed += 1
        return placed

    def _attach_raw(self, pid: int, path: str, addr: int, fn_name: str, retprobe: bool) -> None:
        before = set(self.bpf.uprobe_fds)
        attach = self.bpf.attach_uretprobe if retprobe else self.bpf.attach_uprobe
        attach(name=path.encode(), addr=addr, fn_name=fn_name.encode(), pid=pid)
        self._events.setdefault(pid, []).extend(set(self.bpf.uprobe_fds) - before)

    def _detach_events(self, pid: int) -> None:
        for ev in self._events.pop(pid, []):
            try:
                self.bpf.detach_uprobe_event(ev)
            except Exception:
                # bcc closes the fd first; only the tracefs clean-up can fail,
                # and perf-PMU uprobes have no tracefs entry.
                self.bpf.uprobe_fds.pop(ev, None)

    def detach(self, pid: int) -> None:
        self.probes.pop(pid, None)
        self._detach_events(pid)
        if self._sites.pop(pid, None) is not None:
            # A later process with this pid reports its own sites.
            table = self.bpf["sites"]
            for key in [k for k, _ in table.items() if k.pid == pid]:
                table.pop(key, None)

    # -- draining ----------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> np.ndarray:
        """Wait up to timeout_ms for records; returns them as a CALL_DTYPE array."""
        self.bpf.ring_buffer_poll(timeout_ms)
        if self._sites and time.monotonic() - self._sites_looked >= SITE_SWEEP_S:
            self.place_sites()       # a new site's wake-up record may have been lost
        return self._take()

    def drain(self) -> np.ndarray:
        self.bpf.ring_buffer_consume()
        return self._take()

    def _take(self) -> np.ndarray:
        if not self._chunks:
            return np.empty(0, dtype=CALL_DTYPE)
        buf = b"".join(self._chunks)
        self._chunks.clear()
        recs = np.frombuffer(buf, dtype=CALL_DTYPE)
        marks = (recs["flags"] & GH_F_NEW_SITE) != 0
        if marks.any():
            recs = recs[~marks]
            self.place_sites()
        self.delivered += len(recs)
        return recs

    def lost_total(self) -> int:
        return int(sum(self.bpf["lost"][ct.c_int(0)]))

    def untimed_total(self) -> int:
        """Calls of return-site functions that began before their site was
        probed: at most this many went untimed."""
        return int(sum(self.bpf["untimed"][ct.c_int(0)]))

    def launch_counts(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self.bpf["launches"].items()}

    def close(self) -> None:
        if self.bpf is not None:
            for pid in list(self.probes):
                self.detach(pid)
            self.bpf.cleanup()
            self.bpf = None
