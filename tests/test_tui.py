"""The live view: pure rendering of fixed snapshots on an 80-column (and a
narrow) console, escaping of untrusted names; and a real run in a tmux pane
against a gloo job, stopped with C-c."""
import math
import re
import shutil
import subprocess
import sys

import pytest
from rich.console import Console

from conftest import ROOT, read_events, wait_for
from greyhound_bpf.output.tui import RankRow, Snapshot, TuiState, render, sparkline


def draw(snap, width=80):
    c = Console(width=width, force_terminal=True, color_system=None)
    with c.capture() as cap:
        c.print(render(snap))
    return cap.get()


def snap(**kw):
    rows = tuple(RankRow(r, 4300 + r, "python3", 31.2, 0.4, 120.0, "ok") for r in range(4))
    base = dict(job="torchrun-4242", elapsed_s=75.0, probes=36, events_per_s=480.0, lost=0,
                ranks=rows, history=tuple(30 + math.sin(i) for i in range(100)), marks=(),
                log=(("07:00:01", "info", "attached 9 probes to rank 0"),), mode="advise",
                width=80)
    base.update(kw)
    return Snapshot(**base)


def widths(text):
    return max(len(line) for line in text.splitlines())


def test_healthy():
    out = draw(snap())
    assert widths(out) <= 80
    assert "torchrun-4242" in out and "4 ranks" in out and "36 probes" in out
    assert "lost 0" in out and "1:15" in out
    for r in range(4):
        assert f"430{r}" in out
    assert out.count(" ok ") + out.count(" ok\u2502") >= 0
    assert "60/ 40%" in out and "31.2" in out
    assert "attached 9 probes" in out and "Ctrl-C" in out
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")


def test_slow_rank_and_marks():
    rows = list(snap().ranks)
    rows[2] = RankRow(2, 4302, "python3", 62.0, 0.1, 60.0, "straggler")
    hist = tuple([30.0] * 50 + [60.0] * 30 + [35.0] * 20)
    out = draw(snap(ranks=tuple(rows), history=hist, marks=((50, "slowdown"), (55, "action"),
                                                            (56, "applied")),
                    log=(("07:00:01", "slowdown", "SLOWDOWN job from iteration 50: 30.0 -> "
                                                  "60.0 ms (x2.00, p=1.00)"),),
                    mode="mitigate", lost=12))
    assert widths(out) <= 80
    assert "straggler" in out and "62.0" in out and "lost 12" in out
    assert "▼" in out and "◆" in out and "●" in out and "SLOWDOWN job" in out
    assert "mitigation: mitigate" in out
    assert "60.0 ms" in out and "30.0 ms" in out            # the scale of the history


def test_event_log_overflow_keeps_the_latest():
    log = tuple((f"07:00:{i:02d}", "action", f"event number {i} " + "x" * 120) for i in range(40))
    out = draw(snap(log=log))
    assert widths(out) <= 80
    assert "event number 39" in out and "event number 31" not in out   # 8 lines
    assert "event number 32" in out and "…" in out


def test_narrow_terminal():
    out = draw(snap(width=60), width=60)
    assert widths(out) <= 60
    assert "4303" in out and "31.2" in out


def test_untrusted_names_are_escaped():
    rows = (RankRow(0, 1, "[bold]evil[/]\x1b[31m", 1.0, 0.5, 1.0, "ok"),)
    out = draw(snap(ranks=rows, job="[red]job[/red]",
                    log=(("07:00:00", "info", "name \x1b]0;title\x07 [link]"),)))
    assert "[bold]evil[/]" in out and "\x1b" not in out
    assert "[red]job[/red]" in out and "[link]" in out


def test_state_from_events():
    st = TuiState()
    for i in range(5):
        for r in (0, 1):
            st({"kind": "iteration", "rank": r, "index": i, "dur_ns": int((10 + r) * 1e6),
                "time_ns": 0})
    st({"kind": "slowdown", "scope": "job", "index": 4, "detected_index": 4, "before_ms": 10,
        "after_ms": 20, "ratio": 2, "probability": 1, "time_ns": 0})
    st({"kind": "slowdown", "scope": "rank", "rank": 1, "index": 4, "detected_index": 4,
        "before_ms": 10, "after_ms": 20, "ratio": 2, "probability": 1, "time_ns": 0})
    assert list(st.history) == [10.0] * 5           # the lowest rank's: the job's pace
    assert st.marks_in_history() == ((5, "slowdown"),)
    assert st.stragglers == {1} and len(st.log) == 2
    assert sparkline([1, 2, 3], 10) == "▁▅█" and sparkline([5, 5], 4) == "▁▁"


@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="scripts/setup installs tmux")
def test_live_view_in_tmux(ddp_job, tmp_path):
    job = ddp_job(2, 0, "--idle-ms", "5", go=False)
    wait_for(lambda: len(job.truth_records()) >= 2, 90, "the job to start")
    session = f"gh{job.proc.pid}"
    rc = tmp_path / "rc"
    events = tmp_path / "events.jsonl"
    cmd = (f"{sys.executable} -m greyhound_bpf.cli attach {job.proc.pid} -o {events}; "
           f"echo $? > {rc}; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "40",
                    "-c", str(ROOT), cmd], check=True)
    try:
        def pane():
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                  capture_output=True, text=True).stdout
        row = re.compile(r"^│\s+([01])\s+(\d+)\s+\S+\s+(\d+\.\d)\s+\d+/\s*\d+%")

        def ready():
            p = pane()
            found = {m.group(1) for m in map(row.match, p.splitlines()) if m}
            return p if found == {"0", "1"} else None
        screen = wait_for(ready, 90, "both ranks with iteration times", interval=0.5)
        assert max(len(line) for line in screen.splitlines()) <= 80
        assert "ITER ms" in screen and "job iteration time" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_for(rc.exists, 30, "the exit code")
        assert rc.read_text().strip() == "0"
        after = pane()
        assert "calls traced in" in after and "gloo::allreduce" in after
        kinds = {e["kind"] for e in read_events(events)}      # --json alongside the view
        assert {"attach", "iteration", "detach"} <= kinds
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
