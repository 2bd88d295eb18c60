#!/usr/bin/env python3
"""Regenerate the README's CLI reference from the commands' own --help:

    .venv/bin/python scripts/cli_reference.py --write

Without --write it prints the section; tests/test_readme.py fails when the
README's copy differs from what --help says now."""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- cli:begin (scripts/cli_reference.py) -->", "<!-- cli:end -->"
COMMANDS = [["greyhound-trace", "attach"], ["greyhound-trace", "replay"],
            ["greyhound-trace", "report"], ["greyhound-trace", "validate"],
            ["greyhound-trace", "inject"], ["greyhound-trace", "check"],
            ["greyhound-trace", "controller"], ["greyhound-run"]]


def help_text(cmd: list[str]) -> str:
    os.environ["COLUMNS"] = "80"
    if cmd[0] == "greyhound-run":
        from mitigation.supervisor import main
        args = ["--help"]
    else:
        from greyhound_bpf.cli import main
        args = [*cmd[1:], "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(args)
        except SystemExit:
            pass
    return out.getvalue().rstrip()


def section() -> str:
    parts = [BEGIN]
    for cmd in COMMANDS:
        parts += [f"`{' '.join(cmd)} --help`:", "", "```", help_text(cmd), "```", ""]
    parts.append(END)
    return "\n".join(parts)


def main() -> int:
    text = section()
    if "--write" not in sys.argv:
        print(text)
        return 0
    readme = ROOT / "README.md"
    s = readme.read_text()
    a, b = s.index(BEGIN), s.index(END) + len(END)
    readme.write_text(s[:a] + text + s[b:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
