"""`greyhound-trace report EVENTS -o report.html`: a post-mortem of a run.

One self-contained HTML file (plots as inline SVG, drawn with matplotlib;
no script, no network) from an event stream (`attach -o FILE`) or a
recording (`attach --record FILE`, replayed through the analysis first):

- per-rank iteration time over wall time, with slowdowns, recoveries,
  diagnoses, validation pauses and plans marked;
- compute against blocked time per rank, before and during the worst
  episode;
- the validation measurements (GEMM per device, round trip per link)
  against their reference, with the thresholds drawn;
- the plans (micro-batches per rank) over time, and the time lost and
  recovered;
- a table of episodes.

Pure over the events: the same events give the same page.
"""
from __future__ import annotations

import html
import io
import re
import statistics
from dataclasses import dataclass, field

from .. import GreyhoundError
from ..events import KINDS, is_speed_sample

# Points drawn per rank at most: a day-long run is thinned to this many
# (evenly by iteration), which keeps the page a few MB.
MAX_POINTS = 4000


# -- input ---------------------------------------------------------------------

def read_events(path: str, replay=None) -> list[dict]:
    """Events from an event stream, or from a recording given to `replay`
    (the command's `greyhound_bpf.replay.replay`)."""
    from ..recording import _lines
    lines = _lines(path)
    try:
        lineno, first = next(lines)
    except StopIteration:
        raise GreyhoundError(f"{path} is empty") from None
    if "greyhound_recording" in first:
        lines.close()
        if replay is None:
            raise GreyhoundError(f"{path} is a recording: replay it first")
        return replay(path)
    events = []
    for lineno, d in [(lineno, first), *lines]:
        if d.get("kind") not in KINDS or not isinstance(d.get("time_ns"), int):
            raise GreyhoundError(f"{path}:{lineno}: not a greyhound event (no known `kind` "
                                 "and `time_ns`): give `attach -o` output or a recording")
        events.append(d)
    if not events:
        raise GreyhoundError(f"{path} holds no events")
    return events


# -- episodes ------------------------------------------------------------------

@dataclass
class Episode:
    slowdown: dict
    end_ns: int | None = None                  # the recovery's onset; None: until the end
    diagnoses: list[dict] = field(default_factory=list)
    actions: list[dict] = field(default_factory=list)
    lost_s: float = 0.0                        # iteration time beyond the level before
    recovered_s: float = 0.0                   # ...given back after a plan was applied

    @property
    def start_ns(self) -> int:
        return int(self.slowdown["onset_ns"])


def episodes(events: list[dict]) -> list[Episode]:
    """Job slowdowns to their recovery, with what was said and done in
    between, and the time they cost: the lowest rank's speed samples over
    the level before the slowdown; after an applied plan, the part of the
    slow level's excess that the plan took back."""
    eps: list[Episode] = []
    for e in events:
        if e["kind"] == "slowdown" and e.get("scope") == "job":
            if eps and eps[-1].end_ns is None:
                continue                              # a further step of one episode
            eps.append(Episode(e))
        elif e["kind"] == "recovery" and e.get("scope") == "job" and eps \
                and eps[-1].end_ns is None:
            eps[-1].end_ns = int(e["onset_ns"])
        elif eps and e["kind"] == "diagnosis":
            eps[-1].diagnoses.append(e)
        elif eps and e["kind"] == "action" and e.get("strategy") != "none" \
                and e.get("phase") != "outcome":
            eps[-1].actions.append(e)
    series = job_series(events)
    applied = sorted(e["time_ns"] for e in events if e["kind"] == "applied")
    for ep in eps:
        base, slow = float(ep.slowdown["before_ms"]), float(ep.slowdown["after_ms"])
        end = ep.end_ns if ep.end_ns is not None else 1 << 63
        plan_at = next((t for t in applied if t >= ep.start_ns and t < end), None)
        for t, ms in series:
            if ep.start_ns <= t < end:
                ep.lost_s += max(0.0, ms - base) / 1e3
                if plan_at is not None and t >= plan_at:
                    # The slow level's excess this iteration did not pay.
                    ep.recovered_s += min(max(slow - ms, 0.0), slow - base) / 1e3
    return eps


def job_series(events: list[dict]) -> list[tuple[int, float]]:
    """(start_ns, ms) of the lowest rank's speed samples: the job's time."""
    ranks = sorted({e["rank"] for e in events if is_speed_sample(e)})
    if not ranks:
        return []
    return [(int(e["start_ns"]), e["dur_ns"] / 1e6) for e in events
            if is_speed_sample(e) and e["rank"] == ranks[0]]


# -- figures -------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "greyhound",
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    _plt().close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]                # no XML prologue inside HTML
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)


def _thin(points: list, n: int = MAX_POINTS) -> list:
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n)]


def fig_timeline(events: list[dict], t0: int, eps: list[Episode]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4))
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if is_speed_sample(e):
            by_rank.setdefault(e["rank"], []).append(((e["start_ns"] - t0) / 1e9,
                                                      e["dur_ns"] / 1e6))
    for rank, pts in sorted(by_rank.items()):
        pts = _thin(pts)
        xs, ys = [], []
        for (x0, _), (x, y) in zip([pts[0]] + pts[:-1], pts):
            if x - x0 > max(1.0, 10 * y / 1e3):    # no line across a gap (a pause...)
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(x)
            ys.append(y)
        ax.plot(xs, ys, lw=0.7, label=f"rank {rank}")
    spans = {}
    for e in events:
        if e["kind"] == "activity" and e["what"] == "pause":
            spans[e["id"]] = e
    for i, s in enumerate(spans.values()):
        end = s["end_ns"] if s["end_ns"] is not None else events[-1]["time_ns"]
        ax.axvspan((s["start_ns"] - t0) / 1e9, (end - t0) / 1e9, color="0.6", alpha=0.35,
                   lw=0, label="validation pause" if i == 0 else None)
    last = (events[-1]["time_ns"] - t0) / 1e9
    for i, ep in enumerate(eps):
        end = (ep.end_ns - t0) / 1e9 if ep.end_ns is not None else last
        ax.axvspan((ep.start_ns - t0) / 1e9, end, color="tab:red", alpha=0.12, lw=0,
                   label="slowdown to recovery" if i == 0 else None)
    marks = [("diagnosis", "tab:purple", "diagnosis (named)",
              lambda e: e["cause"] != "unknown"),
             ("action", "tab:green", "plan",
              lambda e: e.get("strategy") != "none" and e.get("phase") != "outcome")]
    for kind, color, label, pred in marks:
        xs = [(e["time_ns"] - t0) / 1e9 for e in events if e["kind"] == kind and pred(e)]
        for i, x in enumerate(xs):
            ax.axvline(x, color=color, ls="--", lw=1, label=label if i == 0 else None)
    ax.set_xlabel("seconds since the first event")
    ax.set_ylabel("iteration time (ms)")
    ax.set_ylim(bottom=0)
    if by_rank:
        ax.legend(loc="upper left", ncol=4, fontsize=8, frameon=False)
    return _svg(fig)


def fig_episode(events: list[dict], ep: Episode) -> str:
    """Median compute and blocked time per rank, before the onset and
    during the episode."""
    plt = _plt()
    end = ep.end_ns if ep.end_ns is not None else 1 << 63
    window = int(50 * float(ep.slowdown["before_ms"]) * 1e6)
    rows: dict[int, dict[str, list]] = {}
    for e in events:
        if not is_speed_sample(e) or "compute_ns" not in e:
            continue
        when = "before" if ep.start_ns - window <= e["start_ns"] < ep.start_ns else \
            "during" if ep.start_ns <= e["start_ns"] < end else None
        if when:
            r = rows.setdefault(e["rank"], {"before": [], "during": []})
            r[when].append((e["compute_ns"] / 1e6, e["comm_ns"] / 1e6))
    ranks = [r for r in sorted(rows) if rows[r]["before"] and rows[r]["during"]]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for j, when in enumerate(("before", "during")):
        xs = [i * 3 + j for i in range(len(ranks))]
        comp = [statistics.median(c for c, _ in rows[r][when]) for r in ranks]
        comm = [statistics.median(b for _, b in rows[r][when]) for r in ranks]
        ax.bar(xs, comp, color="tab:blue" if j else "lightsteelblue",
               label=f"compute, {when}")
        ax.bar(xs, comm, bottom=comp, color="tab:orange" if j else "navajowhite",
               label=f"blocked in collectives, {when}")
    ax.set_xticks([i * 3 + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_ylabel("ms per iteration (median)")
    ax.legend(fontsize=8, frameon=False, ncol=2)
    return _svg(fig)


def fig_validation(v: dict) -> str:
    plt = _plt()
    d = v["details"]
    th = d.get("thresholds", {})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for ax, items, key, ref, ratio, unit in (
            (axes[0], d.get("devices", {}), "ms_per_gemm", d.get("gemm_reference_ms"),
             th.get("slow_ratio"), "ms per GEMM"),
            (axes[1], d.get("links", {}), "rtt_ms", d.get("link_reference_ms"),
             th.get("link_slow_ratio"), "round trip (ms)")):
        names = list(items)
        vals = [items[n].get(key, 0) for n in names]
        ax.bar(range(len(names)), vals, color="tab:cyan")
        ax.set_xticks(range(len(names)), [f"rank {n}" if key == "ms_per_gemm" else n
                                          for n in names], fontsize=8)
        if ref:
            ax.axhline(ref, color="k", lw=1, label=f"reference {ref:.3g}")
            if ratio:
                ax.axhline(ref * ratio, color="tab:red", ls="--", lw=1,
                           label=f"slow beyond x{ratio:g}")
            ax.legend(fontsize=8, frameon=False)
        ax.set_ylabel(unit)
        ax.set_title("devices (GEMM)" if key == "ms_per_gemm" else "links (p2p)", fontsize=9)
    return _svg(fig)


def fig_plans(events: list[dict], t0: int, eps: list[Episode]) -> str:
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2),
                                 gridspec_kw={"width_ratios": [3, 1]})
    plans = [e for e in events if e["kind"] == "action" and e.get("phase") != "outcome"
             and (e.get("plan") or {}).get("microbatches")]
    end = (events[-1]["time_ns"] - t0) / 1e9
    per_rank: dict[str, list[tuple[float, int]]] = {}
    for p in plans:
        for r, n in p["plan"]["microbatches"].items():
            per_rank.setdefault(str(r), []).append(((p["time_ns"] - t0) / 1e9, n))
    for r, pts in sorted(per_rank.items(), key=lambda kv: int(kv[0])):
        xs = [x for x, _ in pts] + [end]
        ax.step(xs, [n for _, n in pts] + [pts[-1][1]], where="post", label=f"rank {r}")
    ax.set_xlabel("seconds since the first event")
    ax.set_ylabel("micro-batches per step")
    ax.set_xlim(0, max(end, 1))
    if per_rank:
        ax.legend(fontsize=8, frameon=False, ncol=4, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no micro-batch plan in this run", ha="center",
                transform=ax.transAxes)
    lost = sum(e.lost_s for e in eps)
    rec = sum(e.recovered_s for e in eps)
    bx.bar([0, 1], [lost, rec], color=["tab:red", "tab:green"])
    bx.set_xticks([0, 1], ["lost", "recovered\nby plans"])
    bx.set_ylabel("job seconds")
    return _svg(fig)


# -- page ----------------------------------------------------------------------

def _table(eps: list[Episode], t0: int) -> str:
    def cell(x) -> str:
        return f"<td>{html.escape(str(x))}</td>"
    rows = []
    for i, ep in enumerate(eps, 1):
        named = [d for d in ep.diagnoses if d["cause"] != "unknown"]
        verdict = "; ".join(
            f"{d['cause']} {d['ranks'] or d.get('link') or ''} ({d['evidence']})"
            for d in named[:3]) or "not named"
        acts = ", ".join(sorted({f"{a['strategy']} ({a.get('mode', 'advise')})"
                                 for a in ep.actions})) or "none"
        end = f"{(ep.end_ns - t0) / 1e9:.1f}" if ep.end_ns is not None else "(to the end)"
        rows.append("<tr>" + "".join(cell(x) for x in (
            i, f"{(ep.start_ns - t0) / 1e9:.1f}", end,
            f"x{ep.slowdown['ratio']:.2f} ({ep.slowdown['before_ms']:.1f} -> "
            f"{ep.slowdown['after_ms']:.1f} ms)", verdict, acts,
            f"{ep.lost_s:.2f}", f"{ep.recovered_s:.2f}")) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("#", "start (s)", "end (s)", "slowdown",
                                              "diagnosis", "plans", "lost (s)",
                                              "recovered (s)"))
    body = "".join(rows) or '<tr><td colspan="8">no job slowdown</td></tr>'
    return f"<table><tr>{head}</tr>{body}</table>"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em}
th{background:#f3f3f3}.figure svg{max-width:100%;height:auto}.note{color:#666}"""


def render(events: list[dict], source: str = "") -> str:
    """The report page for these events."""
    if not events:
        raise GreyhoundError("no events to report on")
    events = sorted(events, key=lambda e: e["time_ns"])
    t0 = events[0]["time_ns"]
    job = events[0].get("job", "")
    eps = episodes(events)
    n_iter = sum(1 for e in events if is_speed_sample(e))
    ranks = sorted({e["rank"] for e in events if is_speed_sample(e)})
    validations = [e for e in events if e["kind"] == "diagnosis"
                   and e.get("evidence") == "validation" and e["details"].get("devices")]
    parts = [f"<h1>Greyhound report: {html.escape(job)}</h1>",
             f'<p class="note">{html.escape(source)}: {len(events)} events, {n_iter} '
             f"iterations of {len(ranks)} rank(s) over "
             f"{(events[-1]['time_ns'] - t0) / 1e9:.1f} s; {len(eps)} episode(s), "
             f"{len(validations)} validation(s).</p>",
             "<h2>Episodes</h2>", _table(eps, t0),
             "<h2>Iteration time per rank</h2>",
             f'<div class="figure" id="timeline">{fig_timeline(events, t0, eps)}</div>']
    if eps:
        worst = max(eps, key=lambda ep: ep.lost_s)
        parts += [f"<h2>Compute and blocked time, the worst episode (from "
                  f"{(worst.start_ns - t0) / 1e9:.1f} s, {worst.lost_s:.1f} s lost)</h2>",
                  f'<div class="figure" id="episode">{fig_episode(events, worst)}</div>']
    for i, v in enumerate(validations[-3:]):
        parts += [f"<h2>Validation at {(v['time_ns'] - t0) / 1e9:.1f} s: "
                  f"{html.escape(v['reason'])}</h2>",
                  f'<div class="figure" id="validation-{i}">{fig_validation(v)}</div>']
    # Verdicts a plan confirmed by running as it predicted: not measured.
    for v in [e for e in events if e["kind"] == "validation"
              and e.get("confirmed_by") == "plan"][-3:]:
        parts += [f'<h2 class="confirmed">Confirmed by a plan at {(v["time_ns"] - t0) / 1e9:.1f}'
                  f" s: {html.escape(str(v.get('cause')))} rank(s) "
                  f"{html.escape(str(v.get('ranks')))}</h2>",
                  f'<p class="note">{html.escape(v["reason"])}</p>']
    parts += ["<h2>Plans, and the time lost and recovered</h2>",
              f'<div class="figure" id="plans">{fig_plans(events, t0, eps)}</div>']
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>Greyhound report: {html.escape(job)}</title><style>{STYLE}</style>"
            "</head><body>" + "".join(parts) + "</body></html>\n")
