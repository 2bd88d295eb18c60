"""S3 for real: scripts/pipeline_train.py, a GPipe schedule over gloo
send/recv (2 stages x 2 data-parallel replicas), follows a reconfigure_pipeline
plan through greyhound-run: it checkpoints, relaunches with the new layer
split, every block's parameters move to the stage that now holds it, and
the losses continue exactly as an uninterrupted run's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import BIN, ROOT, free_port, kill_tree, read_jsonl, wait_for
from mitigation.control import ControlWriter

pytestmark = pytest.mark.slow
TRAINER = ROOT / "scripts" / "pipeline_train.py"
STEPS = 12
COMMON = ("--pp", "2", "--blocks", "8", "--hidden", "64", "--microbatches", "4",
          "--idle-ms", "50", "--seed", "5")


def launch(work: Path, *args: str, prefix: list[str] = ()) -> subprocess.Popen:
    out = open(work / "job.out", "w")
    cmd = [*prefix, str(BIN / "torchrun"), "--nproc-per-node",
           "{nproc}" if prefix else "4", "--master-port", str(free_port()), str(TRAINER),
           "--steps", str(STEPS), "--truth", str(work / "truth.jsonl"), *COMMON, *args]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def losses(truth: Path) -> dict[tuple[int, int], float]:
    out = {}
    for d in read_jsonl(truth):
        if "loss" in d:
            assert (d["rank"], d["index"]) not in out, "a step ran twice"
            out[d["rank"], d["index"]] = d["loss"]
    return out


def test_a_resplit_moves_the_layers_and_the_losses_continue(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    base.mkdir()
    run.mkdir()
    p = launch(base)
    try:
        assert p.wait(timeout=240) == 0, (base / "job.out").read_text()[-3000:]
    finally:
        kill_tree(p)
    ctl = run / "ctl.json"
    sup = [str(Path(sys.executable).parent / "greyhound-run"), "--control-file", str(ctl),
           "--nproc", "4", "--"]
    p = launch(run, "--control-file", str(ctl), "--checkpoint", str(run / "ckpt"), prefix=sup)
    try:
        wait_for(lambda: sum("loss" in d for d in read_jsonl(run / "truth.jsonl")) >= 8, 180,
                 "the pipeline to train")
        acks = ControlWriter(ctl).ack_docs()
        assert {r: (a["stage"], a["layer_split"]) for r, a in acks.items()} == \
            {0: (0, [4, 4]), 1: (1, [4, 4]), 2: (0, [4, 4]), 3: (1, [4, 4])}
        assert all("microbatches" not in a for a in acks.values())   # not to be rebalanced
        ControlWriter(ctl).issue("reconfigure_pipeline", layer_split=[6, 2], reason="test",
                                 restart={"checkpoint": True})
        assert p.wait(timeout=240) == 0, (run / "job.out").read_text()[-3000:]
    finally:
        kill_tree(p)
    recs = read_jsonl(run / "truth.jsonl")
    splits = {(d["rank"], d["index"]): d["layer_split"] for d in recs if "layer_split" in d}
    assert {tuple(v) for v in splits.values()} == {(4, 4), (6, 2)}
    first_new = min(i for (_, i), v in splits.items() if v == [6, 2])
    assert all(v == ([6, 2] if i >= first_new else [4, 4]) for (_, i), v in splits.items())
    assert sorted(d["exit_code"] for d in recs if d.get("final")) == [0] * 4 + [75] * 4
    a, b = losses(base / "truth.jsonl"), losses(run / "truth.jsonl")
    assert set(a) == set(b) == {(r, i) for r in (1, 3) for i in range(STEPS)}
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), k
