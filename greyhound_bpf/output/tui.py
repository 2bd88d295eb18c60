"""The live terminal view of `attach`: rich, and rendering kept pure.

``TuiState`` is a sink of the event stream (like the JSON writer and the
metrics) and keeps what the view shows: the job's iteration-time history,
marks for slowdowns and actions, and the event log. The session turns it
into a ``Snapshot`` (plain data) a few times per second, and
``render(snapshot)`` turns that into a rich renderable: no I/O, no threads,
no clock, so fixed snapshots render the same every time (tests/test_tui.py).
Every string that comes from the target (process and symbol names) is shown
as rich ``Text`` after ``safe()``: never parsed as markup, never an escape
sequence.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..events import is_speed_sample
from .text import describe, safe

SPARKS = "▁▂▃▄▅▆▇█"
LOG_LINES = 8
HISTORY = 600          # job iteration times kept (the view shows the latest that fit)
STATE_STYLE = {"ok": "green", "slow": "bold red", "straggler": "bold red reverse",
               "warming up": "yellow", "relocking": "yellow"}
MARK = {"slowdown": ("▼", "bold red"), "recovery": ("▲", "green"),
        "action": ("◆", "bold cyan"), "applied": ("●", "cyan")}


@dataclass(frozen=True)
class RankRow:
    rank: int | None
    pid: int
    comm: str
    iter_ms: float | None
    comm_frac: float | None
    calls_per_s: float
    state: str


@dataclass(frozen=True)
class Snapshot:
    job: str
    elapsed_s: float
    probes: int
    events_per_s: float
    lost: int
    ranks: tuple[RankRow, ...]
    history: tuple[float, ...]                 # job iteration time (ms), oldest first
    marks: tuple[tuple[int, str], ...]         # (position in history, event kind)
    log: tuple[tuple[str, str, str], ...]      # (HH:MM:SS, kind, text), oldest first
    mode: str = "advise"                       # mitigation: advise / mitigate
    width: int | None = None                   # the terminal's, for the history line


@dataclass
class TuiState:
    """Event sink: what the view needs, bounded in memory."""
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    marks: deque = field(default_factory=lambda: deque(maxlen=200))
    log: deque = field(default_factory=lambda: deque(maxlen=200))
    stragglers: set = field(default_factory=set)
    _n: int = 0                                 # job iterations seen so far
    _lowest: int | None = None
    _rates: dict = field(default_factory=dict)  # pid -> (time, calls) at the last view
    _calls_total: tuple = (0.0, 0)

    def __call__(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "iteration":
            if not is_speed_sample(ev):           # our own activity: not the job's speed
                return
            rank = ev.get("rank")
            if self._lowest is None or (rank is not None and rank < self._lowest):
                self._lowest = rank
            if rank == self._lowest:              # the job's pace, as its detector reads it
                self.history.append(ev["dur_ns"] / 1e6)
                self._n += 1
            return
        if kind in MARK and ev.get("scope", "job") == "job" and ev.get("phase") != "outcome":
            self.marks.append((self._n, kind))
        if kind == "slowdown" and ev.get("scope") == "rank":
            self.stragglers.add(ev.get("rank"))
        if kind == "recovery" and ev.get("scope") == "rank":
            self.stragglers.discard(ev.get("rank"))
        text = describe(ev) if kind != "activity" else None
        if text:
            self.log.append((time.strftime("%H:%M:%S", time.localtime(ev["time_ns"] / 1e9)),
                             kind, text))

    def note(self, text: str) -> None:
        """A line from the tool itself (attached, exited, lost...)."""
        self.log.append((time.strftime("%H:%M:%S"), "info", text))

    def marks_in_history(self) -> tuple[tuple[int, str], ...]:
        first = self._n - len(self.history)
        return tuple((i - first, k) for i, k in self.marks if i >= first)

    def snapshot(self, *, job: str, elapsed_s: float, stats, view, straggler, exited,
                 probes: int, lost: int, mode: str, width: int) -> "Snapshot":
        """The view's plain data now: per-rank rows from the call statistics
        (output.summary.CallStats) and the analysis's `view(pid)`, call
        rates over the last second or so."""
        now = time.monotonic()
        rows = []
        total = 0
        for rs in stats._sorted():
            calls = sum(f.count for f in rs.fns.values())
            total += calls
            t_prev, c_prev = self._rates.get(rs.pid, (now, calls))
            rate = (calls - c_prev) / (now - t_prev) if now > t_prev else 0.0
            if now - t_prev >= 1.0 or rs.pid not in self._rates:
                self._rates[rs.pid] = (now, calls)
            v = view(rs.pid)
            state = v["state"]
            if rs.pid in exited:
                state = "exited"
            elif rs.rank is not None and rs.rank == straggler:
                state = "straggler"
            elif rs.rank in self.stragglers and state == "ok":
                state = "slow"
            rows.append(RankRow(rs.rank, rs.pid, rs.comm, v["iter_ms"], v["comm_frac"],
                                max(rate, 0.0), state))
        t_prev, c_prev = self._calls_total
        ev_rate = (total - c_prev) / (now - t_prev) if t_prev and now > t_prev else 0.0
        if not t_prev or now - t_prev >= 1.0:
            self._calls_total = (now, total)
        return Snapshot(job=job, elapsed_s=elapsed_s, probes=probes,
                        events_per_s=max(ev_rate, 0.0), lost=lost, ranks=tuple(rows),
                        history=tuple(self.history), marks=self.marks_in_history(),
                        log=tuple(self.log), mode=mode, width=width)


# -- rendering (pure) ------------------------------------------------------------

def sparkline(values, width: int) -> str:
    """The last `width` values, one block character each, scaled between
    the minimum and maximum shown."""
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    if span <= 1e-9 * max(abs(hi), 1):
        return SPARKS[0] * len(vals)
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))]
                   for v in vals)


def _fmt(v: float | None, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def render(s: Snapshot):
    width = min(s.width or 80, 120)
    narrow = width < 80
    head = Text()
    head.append("greyhound ", style="bold")
    head.append(safe(s.job, 40), style="bold cyan")
    head.append(f"  {len(s.ranks)} ranks  {s.probes} probes  {s.events_per_s:,.0f} calls/s  ")
    head.append(f"lost {s.lost}", style="bold red" if s.lost else "dim")
    head.append(f"  {int(s.elapsed_s) // 60}:{int(s.elapsed_s) % 60:02d}")
    if not narrow:
        head.append(f"  mitigation: {s.mode}", style="dim")

    table = Table(expand=False, box=None, pad_edge=False, header_style="bold")
    table.add_column("RANK", justify="right")
    table.add_column("PID", justify="right")
    if not narrow:
        table.add_column("PROCESS", max_width=16, no_wrap=True)
    table.add_column("ITER ms", justify="right")
    table.add_column("COMPUTE/COMM", justify="right")
    table.add_column("CALLS/S", justify="right")
    table.add_column("STATE")
    for r in s.ranks:
        split = ("-" if r.comm_frac is None else
                 f"{100 * (1 - r.comm_frac):3.0f}/{100 * r.comm_frac:3.0f}%")
        row = [Text("-" if r.rank is None else str(r.rank)), Text(str(r.pid))]
        if not narrow:
            row.append(Text(safe(r.comm, 16)))
        row += [Text(_fmt(r.iter_ms, ".1f")), Text(split), Text(f"{r.calls_per_s:.0f}"),
                Text(safe(r.state, 12), style=STATE_STYLE.get(r.state, ""))]
        table.add_row(*row)

    graph_w = max(10, width - 4 - 11)      # panel border+padding, the scale label
    hist = Text()
    if s.history:
        shown = list(s.history)[-graph_w:]
        offset = len(s.history) - len(shown)
        hist.append(f"{max(shown):7.1f} ms ", style="dim")
        hist.append(sparkline(shown, graph_w), style="cyan")
        line = [(" ", "")] * len(shown)
        for pos, kind in s.marks:
            p = pos - offset
            if 0 <= p < len(shown):
                line[p] = MARK[kind]
        hist.append("\n")
        hist.append(f"{min(shown):7.1f} ms ", style="dim")
        for ch, st in line:
            hist.append(ch, style=st)
    else:
        hist.append("waiting for the first iterations...", style="dim")

    log = Text()
    for i, (stamp, kind, text) in enumerate(list(s.log)[-LOG_LINES:]):
        if i:
            log.append("\n")
        log.append(f"{stamp} ", style="dim")
        style = {"slowdown": "bold red", "recovery": "green", "action": "cyan",
                 "applied": "cyan", "diagnosis": "magenta"}.get(kind, "")
        room = width - 4 - 9
        line = safe(text)
        log.append(line if len(line) <= room else line[:room - 1] + "…", style=style)
    if not s.log:
        log.append("no events yet", style="dim")

    legend = "▼ slowdown ▲ recovery ◆ plan ● applied"
    footer = Text("Ctrl-C: stop, print the summary" if narrow else
                  f"Ctrl-C: stop and print the summary   {legend}", style="dim")
    return Group(
        Panel(head, padding=(0, 1), width=width),
        Panel(table, title="ranks", title_align="left", padding=(0, 1), width=width),
        Panel(hist, title="job iteration time", title_align="left", padding=(0, 1),
              width=width),
        Panel(log, title="events", title_align="left", padding=(0, 1), width=width),
        footer,
    )
