"""Per-rank call statistics and the bcc-style text summary.

``CallStats`` folds decoded record batches into per-(pid, function) counts
and durations; ``format_interval`` and ``format_final`` render them as plain
text under 80 columns. Names that come from the target (process names) are
sanitised before they reach a terminal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..probe.catalog import Catalog
from .text import safe  # noqa: F401  (re-exported)




@dataclass
class FnStats:
    count: int = 0
    total_ns: int = 0
    max_ns: int = 0


@dataclass
class RankStats:
    pid: int
    rank: int | None
    comm: str
    fns: dict[int, FnStats] = field(default_factory=dict)
    interval_count: int = 0
    interval_ns: int = 0
    interval_top: dict[int, list[int]] = field(default_factory=dict)


class CallStats:
    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.ranks: dict[int, RankStats] = {}
        self.interval_start = time.monotonic()

    def add_target(self, pid: int, rank: int | None, comm: str) -> None:
        self.ranks.setdefault(pid, RankStats(pid, rank, comm))

    def add(self, recs: np.ndarray) -> list[tuple[int, int, int]]:
        """Fold a batch in; returns its (pid, function id, calls) groups."""
        if len(recs) == 0:
            return []
        # Group by (pid, fn) with NumPy: a batch may hold thousands of records.
        key = (recs["pid"].astype(np.uint64) << np.uint64(16)) | recs["fn"].astype(np.uint64)
        uniq, inv = np.unique(key, return_inverse=True)
        counts = np.bincount(inv)
        totals = np.bincount(inv, weights=recs["dur_ns"].astype(np.float64))
        maxes = np.zeros(len(uniq), dtype=np.uint64)
        np.maximum.at(maxes, inv, recs["dur_ns"])
        groups = []
        for k, c, tot, mx in zip(uniq.tolist(), counts.tolist(), totals.tolist(), maxes.tolist()):
            pid, fid = k >> 16, k & 0xFFFF
            groups.append((pid, fid, c))
            rs = self.ranks.setdefault(pid, RankStats(pid, None, "?"))
            fs = rs.fns.setdefault(fid, FnStats())
            fs.count += c
            fs.total_ns += int(tot)
            fs.max_ns = max(fs.max_ns, mx)
            rs.interval_count += c
            rs.interval_ns += int(tot)
            top = rs.interval_top.setdefault(fid, [0, 0])
            top[0] += c
            top[1] += int(tot)
        return groups

    def _sorted(self) -> list[RankStats]:
        return sorted(self.ranks.values(),
                      key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid))

    def format_interval(self, view=None) -> str:
        """One line per rank. `view(pid)` gives the engine's state for it:
        iteration time, comm share and state (warming up, ok, slow)."""
        now = time.monotonic()
        span = max(now - self.interval_start, 1e-9)
        stamp = time.strftime("%H:%M:%S")
        lines = [f"{stamp} {'RANK':>4} {'PID':>7} {'CALLS/S':>7} {'ITER ms':>8} {'COMM':>5} "
                 f"{'STATE':<10} {'TOP FUNCTION':<15} {'MEAN ms':>7}"]
        for rs in self._sorted():
            if rs.interval_top:
                fid, (n, tot) = max(rs.interval_top.items(), key=lambda kv: kv[1][1])
                top = self.catalog.functions[fid].name
                mean = f"{tot / n / 1e6:7.3f}"
            else:
                top, n, mean = "-", 0, "-"
            v = view(rs.pid) if view else {}
            it = f"{v['iter_ms']:8.2f}" if v.get("iter_ms") is not None else f"{'-':>8}"
            cf = f"{100 * v['comm_frac']:4.0f}%" if v.get("comm_frac") is not None else f"{'-':>5}"
            state = safe(v.get("state") or "-", 10)
            rank = "-" if rs.rank is None else str(rs.rank)
            lines.append(f"{'':8} {rank:>4} {rs.pid:>7} {rs.interval_count / span:7.1f} "
                         f"{it} {cf} {state:<10} {safe(top, 15):<15} {mean[-7:]:>7}")
            rs.interval_count, rs.interval_ns = 0, 0
            rs.interval_top.clear()
        self.interval_start = now
        return "\n".join(lines)

    def format_final(self, lost: int, delivered: int, elapsed_s: float) -> str:
        lines = [f"greyhound-trace: {delivered} calls traced in {elapsed_s:.1f} s, "
                 f"{lost} lost"]
        lines.append(f"{'RANK':>4} {'PID':>7} {'FUNCTION':<28} {'CALLS':>8} "
                     f"{'MEAN ms':>8} {'MAX ms':>8} {'TOTAL s':>8}")
        for rs in self._sorted():
            rank = "-" if rs.rank is None else str(rs.rank)
            if not rs.fns:
                lines.append(f"{rank:>4} {rs.pid:>7} {'(no calls)':<28}")
            for fid, fs in sorted(rs.fns.items(), key=lambda kv: -kv[1].total_ns):
                name = safe(self.catalog.functions[fid].name, 28)
                lines.append(f"{rank:>4} {rs.pid:>7} {name:<28} {fs.count:>8} "
                             f"{fs.total_ns / fs.count / 1e6:8.3f} {fs.max_ns / 1e6:8.3f} "
                             f"{fs.total_ns / 1e9:8.3f}")
        return "\n".join(lines)


def final_report(stats: CallStats, lost: int, delivered: int, elapsed_s: float,
                 validations: int, paused_s: float, lost_output: list[tuple],
                 launches: dict, untimed: int = 0) -> str:
    """What `attach` prints when it ends: the calls per rank, validation's
    pauses, output that could not be written ((what, count, noun, why)),
    kernel-counted launches, and calls of functions that may throw that
    began before their caller's return site was probed (probes/greyhound.h)."""
    elapsed_s = max(elapsed_s, 1e-9)
    lines = [stats.format_final(lost, delivered, elapsed_s),
             f"greyhound-trace: {validations} validation(s), job paused {paused_s:.1f} s "
             f"({100 * paused_s / elapsed_s:.2f}% of {elapsed_s:.0f} s)"]
    lines += [f"greyhound-trace: {what}: {n} {noun} ({why})"
              for what, n, noun, why in lost_output if n]
    if untimed:
        lines.append(f"greyhound-trace: {untimed} call(s) began before their caller's return "
                     "site was probed (the first from each caller): at most that many untimed")
    lines += [f"pid {pid}: {n} cudaLaunchKernel calls (counted in the kernel)"
              for pid, n in launches.items()]
    return "\n".join(lines)
