"""`greyhound-trace report`: the post-mortem page, rendered for a recorded
scenario (replayed) and loaded in a real headless Chromium, whose DOM and
screenshot must show the plots."""
from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from harness import GREYHOUND, ROOT

SCENARIO = ROOT / "tests" / "scenarios" / "compute-demo4-r2.rec.gz"
CHROMIUM = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync")
SVG = "{http://www.w3.org/2000/svg}"


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium is not installed: scripts/setup installs it"
    return subprocess.run([exe, *CHROMIUM, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    r = subprocess.run([*GREYHOUND, "report", str(SCENARIO), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_the_page_holds_every_section_with_plots(page):
    text = page.read_text()
    for section in ("Episodes", "Iteration time per rank", "Compute and blocked time",
                    "Validation at", "Plans, and the time lost and recovered"):
        assert section in text, section
    for fetch in ("<script", "<link", 'src="', "href=\"http", "url(http"):
        assert fetch not in text, fetch              # self-contained: nothing to fetch
    svgs = [text[i:text.index("</svg>", i) + 6] for i in range(len(text))
            if text.startswith("<svg", i)]
    assert len(svgs) == 4
    for svg in svgs:                                 # each one well-formed, with marks on it
        root = ET.fromstring(svg)
        assert len(root.findall(f".//{SVG}path")) >= 10
    # The scenario's fault: rank 2's GEMM named by validation, a rebalance.
    assert "computation [2] (validation)" in text and "rebalance_microbatches" in text


def test_the_same_events_give_the_same_page(page, tmp_path):
    again = tmp_path / "again.html"
    r = subprocess.run([*GREYHOUND, "report", str(SCENARIO), "-o", str(again)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and again.read_text() == page.read_text()


def test_chromium_loads_the_page_and_draws_the_plots(page, tmp_path):
    r = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert dom.count("<svg") == 4 and "Iteration time per rank" in dom
    shot = tmp_path / "shot.png"
    r = chromium(tmp_path, "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri())
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    import matplotlib.image
    img = matplotlib.image.imread(str(shot))[:, :, :3]
    ink = (img.sum(axis=2) < 2.9)                    # not white
    assert ink.mean() > 0.03, "the page is (nearly) blank"
    # The timeline's lines and bands are coloured, not only text.
    colourful = (img.max(axis=2) - img.min(axis=2)) > 0.25
    assert colourful.mean() > 0.01
    # Every figure's rows hold ink: none drew empty.
    rows = ink.mean(axis=1)
    assert (rows > 0.05).sum() > 400


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "slowdown", "time_ns": 1}\n{"hello": 1}\n')
    out = tmp_path / "r.html"
    r = subprocess.run([*GREYHOUND, "report", str(bad), "-o", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    r = subprocess.run([*GREYHOUND, "report", str(tmp_path / "none.jsonl"), "-o", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read" in r.stderr and not out.exists()
