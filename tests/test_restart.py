"""S4 for real: a checkpoint_restart plan makes the gloo DDP trainer save a
checkpoint and exit 75; greyhound-run relaunches it; training resumes from
the checkpoint with identical parameters, and the loss continues exactly as
in an uninterrupted run of the same job."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DDPJob, read_events, wait_for
from mitigation.control import ControlWriter

STEPS = 14


def losses(truth: Path) -> dict[tuple[int, int], float]:
    out = {}
    for d in read_events(truth):
        if not d.get("final") and "layer_split" not in d:
            assert (d["rank"], d["index"]) not in out, "a step ran twice"
            out[d["rank"], d["index"]] = d["loss"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["checkpoint_restart", "reconfigure_pipeline"])
def test_checkpoint_restart_resumes_exactly(tmp_path, strategy):
    base_dir, run_dir = tmp_path / "base", tmp_path / "run"
    base_dir.mkdir()
    run_dir.mkdir()
    common = ["--idle-ms", "60", "--microbatches", "2", "--seed", "3"]
    base = DDPJob(base_dir, 2, STEPS, *common, "--control-file", str(base_dir / "ctl.json"),
                  "--save-final", str(base_dir / "final.pt"), go=False)
    try:
        assert base.wait(180) == 0
    finally:
        base.close()

    ctl = run_dir / "ctl.json"
    sup = str(Path(sys.executable).parent / "greyhound-run")
    job = DDPJob(run_dir, 2, STEPS, *common, "--control-file", str(ctl),
                 "--checkpoint", str(run_dir / "ckpt.pt"),
                 "--save-final", str(run_dir / "final.pt"), go=False,
                 prefix=[sup, "--control-file", str(ctl), "--nproc", "2", "--"])
    try:
        wait_for(lambda: len(job.truth_records()) >= 8, 120, "the job to train")
        extra = {"layer_split": [3, 5]} if strategy == "reconfigure_pipeline" else {}
        plan = ControlWriter(ctl).issue(strategy, restart={"checkpoint": True},
                                        reason="test", **extra)
        assert job.wait(240) == 0
    finally:
        job.close()
    log = Path(job.log.name).read_text()
    assert "restarting from" in log, log[-2000:]
    finals = [d for d in read_events(job.truth) if d.get("final")]
    assert sorted(d["exit_code"] for d in finals) == [0, 0, 75, 75]
    restart = json.loads(Path(f"{ctl}.restart").read_text())
    assert restart["seq"] == plan.seq
    # A re-split reaches the relaunched trainer (greyhound-run's
    # GREYHOUND_LAYER_SPLIT); this demo model records what it would build.
    splits = [d for d in read_events(job.truth) if "layer_split" in d]
    if strategy == "reconfigure_pipeline":
        assert sorted(d["rank"] for d in splits) == [0, 1]
        assert all(d["layer_split"] == [3, 5] for d in splits)
        assert "with layers per stage [3, 5]" in log
    else:
        assert splits == []
    ckpt_step = torch.load(run_dir / "ckpt.pt", weights_only=False)["step"]
    assert 0 < ckpt_step < STEPS
    # Every step once, each with the uninterrupted run's loss.
    a, b = losses(base.truth), losses(job.truth)
    assert set(a) == set(b) == {(r, i) for r in range(2) for i in range(STEPS)}
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
    pa = torch.load(base_dir / "final.pt")
    pb = torch.load(run_dir / "final.pt")
    assert all(torch.allclose(pa[k], pb[k], rtol=0, atol=1e-7) for k in pa)
    # The supervisor measured what the restart cost.
    cost = json.loads(Path(f"{ctl}.restart_cost").read_text())
    assert 0 < cost["restart_s"] < 120
    assert ControlWriter(ctl).restart_observed_s() == pytest.approx(cost["restart_s"])


def test_supervisor_bad_usage(tmp_path):
    sup = str(Path(sys.executable).parent / "greyhound-run")
    r = subprocess.run([sup, "--control-file", str(tmp_path / "c.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "after --" in r.stderr
    r = subprocess.run([sup, "--control-file", str(tmp_path / "no" / "c.json"), "--", "true"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no directory" in r.stderr
    # No restart request: the job's own exit code comes back.
    r = subprocess.run([sup, "--control-file", str(tmp_path / "c.json"), "--",
                        sys.executable, "-c", "raise SystemExit(7)"],
                       capture_output=True, text=True)
    assert r.returncode == 7
