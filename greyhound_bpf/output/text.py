"""One line of text per event, for the text output and the live view's log.
Every string that came from the target is made printable first."""
from __future__ import annotations


def describe_engine_event(kind: str, f: dict) -> str:
    """One line for the text output."""
    who = "job" if f.get("scope") == "job" else f"rank {f.get('rank')}"
    if kind in ("slowdown", "recovery"):
        return (f"{kind.upper()} {who} from iteration {f['index']}: {f['before_ms']:.1f} -> "
                f"{f['after_ms']:.1f} ms (x{f['ratio']:.2f}, p={f['probability']:.2f})")
    if kind == "action":
        if f.get("phase") == "outcome":
            return (f"OUTCOME plan {f['seq']}: {f['achieved_ms']:.1f} ms per iteration "
                    f"(expected {f['expected_ms']:.1f})")
        head = "PLAN" if f.get("seq") is not None else "ADVICE"
        plan = f" {f['plan']}" if f.get("plan") else ""
        seq = f" {f['seq']}" if f.get("seq") is not None else ""
        exp = f", expected {f['expected_ms']:.1f} ms" if f.get("expected_ms") else ""
        return f"{head}{seq} {f['strategy']}{plan}: {f['reason']}{exp}"
    if kind == "diagnosis":
        who = f" rank(s) {f['ranks']}" if f.get("ranks") and f["cause"] == "computation" else ""
        if f.get("link"):
            who = f" link {f['link']}"
        return f"DIAGNOSIS ({f['evidence']}) {f['cause']}{who}: {f['reason']}"
    if kind == "topology":
        parts = [f"{c['name']} ranks {_span(c['ranks'])} ({c['source']}"
                 + (f", from {c['parent']}" if c.get("parent") else "")
                 + (", FAILED" if c["state"] == "failed" else "") + ")"
                 for c in f["communicators"]]
        edges = ", ".join(f"{a}<->{b}" for a, b in f["p2p_edges"])
        return "TOPOLOGY " + "; ".join(parts) + (f"; p2p edges {edges}" if edges else "")
    if kind == "applied":
        return f"APPLIED plan {f['seq']} by ranks {f['ranks']} after {f['after_ms']:.0f} ms"
    if kind == "pattern":
        prev = "" if f["previous"] is None else f" (was {f['previous']})"
        return (f"pattern rank {f['rank']}: {f['period_calls']} calls per iteration{prev}"
                + (", split at long host gaps" if f["gap_classes"] else ""))
    return f"{kind} {f}"


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; anything else as a list."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
