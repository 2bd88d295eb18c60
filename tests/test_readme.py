"""The README's CLI reference is what --help says now."""
import subprocess
import sys

from conftest import ROOT


def test_cli_reference_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py")],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out in (ROOT / "README.md").read_text(), \
        "README's CLI reference is stale: run scripts/cli_reference.py --write"
    assert "greyhound-trace inject --help" in out and "--mitigate" in out
