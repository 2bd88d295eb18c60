"""Greyhound under its own faults (issue #18): every row of the fault table
run for real, by the tests that check it (real signals, a real tmpfs, real
cgroups, a real wall-clock step, real killed ranks), and printed as a table:
the fault, what must hold, whether it held, and what was lost.

A row holds when every test of it passed; "lost" is what those tests
measured and recorded (pytest's record_property, read back from the JUnit
report), or "nothing" when they found nothing lost. A row that no test here
checks says so instead of yes.

    sudo scripts/bench_faults                 # every row (about 10 minutes)
    sudo scripts/bench_faults --rows 7 10     # some of them
    sudo scripts/bench_faults --markdown      # the README's table
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (fault, must hold, test node ids); `None` marks what is not tested yet.
ROWS: list[tuple[str, str, list[str] | None]] = [
    ("terminal closed (SIGHUP) during `scripts/demo`",
     "the job, the injection and the tracer gone",
     ["tests/test_demo.py::test_demo_ctrl_c_leaves_nothing[SIGHUP]"]),
    ("SIGHUP during `attach`", "no probe left; the job unharmed",
     ["tests/test_cleanup.py::test_no_probe_left_after_exit[SIGHUP]"]),
    ("SIGHUP during `inject`", "the quota undone",
     ["tests/test_inject.py::test_compute_undone_on_signal[SIGHUP]"]),
    ("SIGHUP during `validate`'s pause", "the job resumes at once; no worker left",
     ["tests/test_faults.py::test_terminal_closed_during_validate"]),
    ("`kill -9` of `attach` during a validation pause",
     "the job resumes within --pause-max; no probe or worker left; the next attach starts",
     ["tests/test_faults.py::test_kill_9_of_attach_during_a_validation_pause"]),
    ("`kill -9` of `inject` (cgroup v1)", "`inject --undo-all` restores everything",
     ["tests/test_inject.py::test_undo_all_after_sigkill"]),
    ("`kill -9` of `inject` (cgroup v2)", "`inject --undo-all` restores everything",
     ["tests/test_cgroup_v2.py::test_undo_all_after_sigkill"]),
    ("`-o` / `--record` on a full disk", "one line each; tracing goes on; lost output counted",
     ["tests/test_faults.py::test_events_to_a_full_device_are_counted_not_fatal",
      "tests/test_faults.py::test_a_full_disk_under_json_and_record"]),
    ("control directory read-only or removed during `--mitigate`",
     "one warning; advise-only from then on; the trainer keeps its plan",
     ["tests/test_faults.py::test_control_directory_lost_while_mitigating",
      "tests/test_control.py::test_a_removed_control_directory_keeps_the_trainers_plan"]),
    ("two `attach --mitigate` on one control file",
     "the second advises only; a third writes once the first is killed",
     ["tests/test_faults.py::test_two_attach_on_one_control_file"]),
    ("a rank killed inside a collective",
     "survivors catch gloo's error (no std::terminate); `exit` event; survivors still traced",
     ["tests/test_faults.py::test_a_rank_killed_inside_a_collective"]),
    ("the wall clock stepped by +-30 s", "no iteration, slowdown or pause mis-timed",
     ["tests/test_faults.py::test_the_wall_clock_stepped_mid_run"]),
    ("a malformed, truncated or hostile recording to `replay`",
     "one line naming the line; exit 2; no traceback",
     ["tests/test_replay.py::test_bad_recordings_are_rejected",
      "tests/test_replay.py::test_hostile_recordings_get_one_line_naming_the_line"]),
    ("a hostile control file (huge, nested, symlink, FIFO)",
     "refused in bounded time and memory; the last good plan kept",
     ["tests/test_control.py::test_hostile_control_files_are_refused_in_bounded_time_and_memory"]),
]
NOT_TESTED = "no test checks this row yet"


def run(nodes: list[str], report: Path) -> dict[str, dict]:
    """node id -> {"outcome", "properties"} from one pytest run."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "-o", "junit_family=xunit1", *nodes],
                   cwd=ROOT, env=env, check=False)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        # The module that ran it (classname), not the file that defines it:
        # test_cgroup_v2.py runs test_inject.py's tests again under v2.
        file = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{file}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        results[node] = {"outcome": outcome, "properties": props}
    return results


def outcome(results: dict[str, dict], node: str) -> dict:
    """A node's result; a node named without its parameters passed when
    every parametrized case of it did."""
    cases = [r for n, r in results.items() if n == node or n.startswith(node + "[")]
    if not cases:
        return {"outcome": "not run", "properties": {}}
    failed = [r for r in cases if r["outcome"] != "passed"]
    lost = "; ".join(r["properties"]["lost"] for r in cases if r["properties"].get("lost"))
    return {"outcome": failed[0]["outcome"] if failed else "passed",
            "properties": {"lost": lost} if lost else {}}


def table(results: dict[str, dict], rows: list[int], markdown: bool) -> list[str]:
    out = []
    head = ("#", "fault", "must hold", "held", "lost")
    if markdown:
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i in rows:
        fault, hold, nodes = ROWS[i - 1]
        if nodes is None:
            held, lost = "not tested", NOT_TESTED
        else:
            got = [outcome(results, n) for n in nodes]
            bad = [f"{n.split('::')[1]}: {g['outcome']}" for n, g in zip(nodes, got)
                   if g["outcome"] != "passed"]
            held = "yes" if not bad else "NO (" + "; ".join(bad) + ")"
            lost = "; ".join(g["properties"]["lost"] for g in got
                             if g["properties"].get("lost")) or "nothing"
        cells = (str(i), fault, hold, held, lost)
        out.append("| " + " | ".join(cells) + " |" if markdown else
                   f"{i:>2}  {fault:<58.58} {held:<5.40}  {lost}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", metavar="N",
                   help=f"rows to run (1..{len(ROWS)}; default all)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    rows = args.rows or list(range(1, len(ROWS) + 1))
    if any(not 1 <= r <= len(ROWS) for r in rows):
        p.error(f"rows are 1..{len(ROWS)}")
    nodes = [n for r in rows for n in (ROWS[r - 1][2] or [])]
    with tempfile.TemporaryDirectory(prefix="gh-faults-") as d:
        results = run(nodes, Path(d) / "report.xml") if nodes else {}
    print("\n".join(table(results, rows, args.markdown)))
    failed = [r for r in rows if ROWS[r - 1][2] and any(
        outcome(results, n)["outcome"] != "passed" for n in ROWS[r - 1][2])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
