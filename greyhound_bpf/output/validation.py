"""The validation verdict as tables (rich renderables), for `greyhound-trace
validate`: one row per device and per link, with each verdict."""
from __future__ import annotations


def render(fields: dict):
    """Tables per device and per link, with each verdict (rich renderables)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    d = fields["details"]
    slow_ranks = set(fields["ranks"]) if fields["cause"] == "computation" else set()
    links = set((fields["link"] or "").split(", "))
    dev = Table(title="devices (GEMM)", title_justify="left")
    for col in ("rank", "ms / GEMM", "GFLOP/s", "x ref", "verdict"):
        dev.add_column(col, justify="right" if col != "verdict" else "left")
    ref = d.get("gemm_reference_ms")
    for r, g in d["devices"].items():
        ratio = g["ms_per_gemm"] / ref if ref else None
        dev.add_row(r, f"{g['ms_per_gemm']:.2f}", f"{g['gflops']:.1f}",
                    "-" if ratio is None else f"{ratio:.2f}",
                    "SLOW" if int(r) in slow_ranks else "ok")
    lk = Table(title="links (p2p ping-pong, 4 MiB)", title_justify="left")
    for col in ("link", "round trip ms", "Gbit/s", "latency us", "verdict"):
        lk.add_column(col, justify="right" if col != "verdict" else "left")
    for name, v in d["links"].items():
        a, b = name.split("<->")
        slow = (name in links or f"rank {a}" in links or f"rank {b}" in links) \
            and fields["cause"] == "communication"
        lk.add_row(name, f"{v['rtt_ms']:.2f}", f"{v['gbps']:.2f}", f"{v['lat_us']:.0f}",
                   "SLOW" if slow else "ok")
    parts = [dev]
    if d["links"]:
        parts.append(lk)
    for u in d["untested"]:
        parts.append(Text(f"not tested: {u}"))
    verdict = fields["cause"]
    if fields["cause"] != "unknown":
        verdict += f" ({fields['link'] or 'rank ' + ', '.join(map(str, fields['ranks']))})"
    parts.append(Text(f"verdict: {verdict}: {fields['reason']}"))
    pauses = d.get("pauses", 1)
    parts.append(Text(f"{d['seconds']:.1f} s in all; job paused {d['paused_s']:.2f} s"
                      + (f" (the longest of {pauses} pauses)" if pauses > 1 else "")))
    return Group(*parts)
