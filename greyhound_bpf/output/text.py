"""One line of text per event, for the text output and the live view's log.
Every line is made printable (no escape sequences): process names, symbol
names and workers' error messages come from outside the tool."""
from __future__ import annotations


def safe(text: str, width: int | None = None) -> str:
    """Printable form of an untrusted string (no escape sequences)."""
    out = "".join(c if c.isprintable() else "?" for c in text)
    return out[:width] if width else out


def describe(f: dict) -> str | None:
    """One line for an event; None for the kinds that get no line of their
    own (iterations, calls: the summaries and the view show those)."""
    line = _line(f["kind"], f)
    return None if line is None else safe(line)


def _line(kind: str, f: dict) -> str | None:
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
    if kind == "validation":
        if f.get("phase") == "request":
            return (f"VALIDATE {len(f.get('ranks', []))} ranks, {len(f.get('edges', []))} "
                    f"links: {f['reason']}")
        return f"validation {f.get('phase')}: {f.get('reason')}"
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
    if kind == "lost":
        return f"ring buffer full: {f['count']} records lost ({f['total']} in all)"
    if kind == "exit":
        return f"pid {f['pid']} (rank {f.get('rank')}) exited"
    if kind == "activity":
        if f.get("end_ns") is None:
            return f"{f['what']} began (our own activity: the job's iterations meanwhile " \
                   "are not its speed)"
        return f"{f['what']} ended after {(f['end_ns'] - f['start_ns']) / 1e9:.2f} s"
    if kind == "agent":
        back = f" is back after {f['silent_s']:.0f} s" if f.get("silent_s") is not None else \
            " rejoined (a new agent)" if f.get("rejoined") else " joined"
        return f"node {f['node']}: agent {f['agent']}{back}"
    if kind in ("agent_lost", "agent_left"):
        how = (f"lost (silent {f['silent_s']:.0f} s)" if kind == "agent_lost" else "left")
        return (f"node {f['node']}: agent {how}; ranks {f['ranks']} get no verdict and no "
                "plan is written until it is back")
    if kind == "census":
        return (f"all {f['world']} ranks announced once" if f["complete"]
                else "ranks: " + "; ".join(f["problems"]))
    if kind == "gap":
        if f.get("reason"):
            return f"GAP: {f['reason']}"
        return f"node {f['node']}: {f['dropped']} record(s) lost while redis was away"
    if kind in ("iteration", "call", "attach", "detach", "node_event"):
        return None
    return f"{kind} {f}"


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; anything else as a list."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
