"""The BPF side of the tracer: load probes/calls.bpf.c, attach uprobes to the
libraries each target maps, and drain the ring buffer into NumPy records.

One uprobe and one uretprobe per (process, function address), all running
the same two BPF programs: the entry program finds the function from the
address it hit (`probe_fn`, written here as each probe is placed). A
function that may throw gets a uprobe at each return site its callers use
instead of the uretprobe (probes/greyhound.h), placed as the entry probe
reports them.
Symbols are looked up once per library file, in its GNU hash table (bcc's
scan of libtorch_cpu's 440k symbols takes 0.3-0.4 CPU s, the lookup 0.03 s),
and aliases at one address (ncclX / pncclX) are attached once.
"""
from __future__ import annotations

import ctypes as ct
import os
import queue
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import GreyhoundError
from .catalog import Catalog, FunctionSpec, probes_dir
from .discovery import MappedLib, Target
from .records import (CALL_DTYPE, GH_F_NEW_SITE, GH_SITE_NEW, GH_SITE_PROBED,
                      GH_SITE_UNPROBEABLE,
                      GH_SPEC_RETURN_SITE, GhFnSpec, GhProbeKey)
from .sites import exported_functions, runtime_addresses, site_location

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
    runtime: int    # where the process runs it: the entry probe's key


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
        # address -> its state (GH_SITE_PROBED or GH_SITE_UNPROBEABLE).
        self._sites: dict[int, dict[int, int]] = {}
        # (pid, function name) -> why a return site could not be probed: its
        # calls from there go untimed. Read and cleared by the caller.
        self.site_problems: dict[tuple[int, str], str] = {}
        self._sites_looked = 0.0
        # Perf-event fds of detached probes, closed off the caller's thread:
        # the kernel takes each uprobe out with a grace period (0.1 s each
        # here, one at a time), which for a rank's 20-50 probes would stall
        # the loop that drains the ring buffer and attaches relaunched ranks.
        self._closing: queue.Queue = queue.Queue()
        self._closer: threading.Thread | None = None

    # -- loading -----------------------------------------------------------

    def cflags(self) -> list[str]:
        # A record takes its size plus an 8-byte ring header.
        capacity = self.ringbuf_pages * 4096 // (CALL_DTYPE.itemsize + 8)
        wakeup_every = max(1, min(64, capacity // 4))
        return [f"-I{probes_dir()}", f"-DGH_RINGBUF_PAGES={self.ringbuf_pages}",
                f"-DGH_WAKEUP_EVERY={wakeup_every}"]

    def source_path(self) -> str:
        return str(probes_dir() / "calls.bpf.c")

    def load(self) -> None:
        bcc = import_bcc()
        try:
            self.bpf = bcc.BPF(src_file=self.source_path().encode(), cflags=self.cflags())
        except Exception as e:
            raise GreyhoundError(f"BPF program failed to load ({e}); run `greyhound-trace check`",
                                 exit_code=1) from None
        spec_table = self.bpf[b"fn_spec"]
        for fn in self.catalog.functions:
            spec = GhFnSpec(nargs=fn.nargs, deref_mask=fn.deref_mask,
                            field_slot=fn.field_slot, nfields=len(fn.fields),
                            flags=GH_SPEC_RETURN_SITE if fn.return_site else 0)
            for j, (_, off) in enumerate(fn.fields):
                spec.field_off[j] = off
            spec_table[ct.c_int(fn.fid)] = spec
        self.bpf[b"events"].open_ring_buffer(self._on_record)

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
            fam = self.catalog.families[lib.family]
            wanted = {s for fn in fam.functions for s in fn.symbols} | set(fam.counters)
            found = exported_functions(lib.host_path, wanted)
            if found is None:
                from bcc import BPF
                pattern = "^(" + "|".join(re.escape(s) for s in sorted(wanted)) + ")$"
                found = {name.decode(): addr for name, addr in
                         BPF.get_user_functions_and_addresses(lib.host_path.encode(),
                                                              pattern.encode())}
            self._symcache[key] = found
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
            runtime = runtime_addresses(target.pid, lib.host_path, lib.dev, lib.inode,
                                        list(symbols.values()))
            seen_addrs: set[int] = set()
            for fn in fam.functions:
                sym = next((s for s in fn.symbols if s in symbols), None)
                if sym is None or symbols[sym] in seen_addrs:
                    continue
                addr = symbols[sym]
                seen_addrs.add(addr)
                probe = Probe(target.pid, fn, lib.host_path, addr, sym, runtime.get(addr, 0))
                try:
                    if not probe.runtime:
                        raise RuntimeError(f"{sym} at {addr:#x} is in no executable mapping "
                                           f"of {lib.path}")
                    self._attach_one(probe)
                except Exception as e:
                    self._detach_events(target.pid)
                    self._forget(target.pid, [*placed, probe])
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
        self.bpf[b"probe_fn"][GhProbeKey(pid=p.pid, addr=p.runtime)] = ct.c_uint32(p.fn.fid)
        self._attach_raw(p.pid, p.path, p.addr, "gh_enter", retprobe=False)
        if p.fn.return_site:
            return
        try:
            self._attach_raw(p.pid, p.path, p.addr, "gh_return", retprobe=True)
        except Exception:
            self._detach_events(p.pid)
            raise

    def place_sites(self) -> int:
        """Probe the return sites that entry probes reported since the last
        call; returns how many were placed. A call is timed from its site's
        probe on, the call that reported it included if it is still running."""
        placed = 0
        self._sites_looked = time.monotonic()
        table = self.bpf[b"sites"]
        for key, state in table.items():
            pid, addr = key.pid, key.addr
            done = self._sites.get(pid)
            if done is None or state.value != GH_SITE_NEW:
                continue
            if addr in done:
                # Another probed function returns to the same instruction
                # (SendWork::wait and RecvWork::wait, both called through
                # Work::wait): its uprobe there times this one's calls too.
                table[key] = ct.c_uint8(done[addr])
                continue
            where = site_location(pid, addr)
            if not isinstance(where, str):
                try:
                    self._attach_raw(pid, where[0], where[1], "gh_return", retprobe=False)
                except Exception as e:
                    where = f"a uprobe at {addr:#x} failed: {e}"
            if isinstance(where, str):
                if os.path.exists(f"/proc/{pid}"):
                    self.site_problems[(pid, self.catalog.functions[key.fn].name)] = where
                done[addr] = GH_SITE_UNPROBEABLE
            else:
                done[addr] = GH_SITE_PROBED
                placed += 1
            table[key] = ct.c_uint8(done[addr])
        return placed

    def _attach_raw(self, pid: int, path: str, addr: int, fn_name: str, retprobe: bool) -> None:
        before = set(self.bpf.uprobe_fds)
        attach = self.bpf.attach_uretprobe if retprobe else self.bpf.attach_uprobe
        attach(name=path.encode(), addr=addr, fn_name=fn_name.encode(), pid=pid)
        self._events.setdefault(pid, []).extend(set(self.bpf.uprobe_fds) - before)

    def _forget(self, pid: int, probes: list[Probe]) -> None:
        """Drop the entry probes' addresses of `pid` (a later process with
        this pid maps its libraries elsewhere)."""
        table = self.bpf[b"probe_fn"]
        for p in probes:
            table.pop(GhProbeKey(pid=pid, addr=p.runtime), None)

    def _detach_events(self, pid: int) -> None:
        for ev in self._events.pop(pid, []):
            fd = self.bpf.uprobe_fds.pop(ev, None)
            if fd is not None:
                self._closing.put((ev, fd))
        if self._closer is None and not self._closing.empty():
            self._closer = threading.Thread(target=self._close_events, name="probe-closer",
                                            daemon=True)
            self._closer.start()

    def _close_events(self) -> None:
        from bcc.libbcc import lib
        while (item := self._closing.get()) is not None:
            ev, fd = item
            lib.bpf_close_perf_event_fd(fd)
            # Only an event made through tracefs (not the perf uprobe PMU)
            # has an entry there to remove; for the others this fails.
            lib.bpf_detach_uprobe(ev)
            self._closing.task_done()
        self._closing.task_done()

    def to_remove(self) -> int:
        """Uprobes still in the kernel: placed, or detached and being taken out."""
        return self._closing.unfinished_tasks + sum(len(e) for e in self._events.values())

    def detach(self, pid: int) -> None:
        self._detach_events(pid)
        self._forget(pid, self.probes.pop(pid, []))
        if self._sites.pop(pid, None) is not None:
            # A later process with this pid reports its own sites.
            table = self.bpf[b"sites"]
            for key in [k for k, _ in table.items() if k.pid == pid]:
                table.pop(key, None)

    # -- draining ----------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> np.ndarray:
        """Wait up to timeout_ms for records; returns them as a CALL_DTYPE array.
        The wait ends at a wake-up (every GH_WAKEUP_EVERY-th record on a
        CPU) or the timeout; either way the records submitted without one
        are taken too (epoll only reports a wake-up: a job making a few
        calls a second would otherwise reach us in batches seconds late)."""
        self.bpf.ring_buffer_poll(timeout_ms)
        self.bpf.ring_buffer_consume()
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
        return int(sum(self.bpf[b"lost"][ct.c_int(0)]))

    def untimed_total(self) -> int:
        """Calls of return-site functions that began before their site was
        probed: at most this many went untimed."""
        return int(sum(self.bpf[b"untimed"][ct.c_int(0)]))

    def launch_counts(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self.bpf[b"launches"].items()}

    def close(self) -> None:
        if self.bpf is not None:
            for pid in list(self.probes):
                self.detach(pid)
            if self._closer is not None:
                self._closing.put(None)          # after every fd queued before it
                self._closer.join()
                self._closer = None
            self.bpf.cleanup()
            self.bpf = None
