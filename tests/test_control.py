"""The control-file protocol: atomic writes, validation, the last good plan
kept through malformed files, acks, and the loss scale that keeps the
gradient of an uneven micro-batch split equal to the even split's."""
import json
import logging
import os
import shutil
import time
import tracemalloc

import pytest

from mitigation.control import (MAX_DOC_BYTES, ControlFile, ControlWriter, Plan, PlanError,
                                atomic_write_json, loss_scale)


def test_issue_poll_ack_round_trip(tmp_path):
    path = tmp_path / "control.json"
    w = ControlWriter(path)
    ctl = ControlFile(path, rank=1, dp_rank=1)
    assert ctl.poll() is None                     # no file yet
    p1 = w.issue("rebalance_microbatches", microbatches={0: 10, 1: 6, 2: 8, 3: 8},
                 reason="rank 1 slow")
    got = ctl.poll()
    assert got == p1 and got.seq == 1 and got.microbatches_for(1, 8) == 6
    assert got.total_microbatches == 32
    assert ctl.poll() is None                     # unchanged: nothing new
    ctl.announce(microbatches=8, world=4)
    assert {r: d["seq"] for r, d in w.ack_docs().items()} == {1: 0}
    ctl.ack(got, microbatches=6)
    assert {r: d["seq"] for r, d in w.ack_docs().items()} == {1: 1}
    doc = w.ack_docs()[1]
    assert doc["microbatches"] == 6 and doc["world"] == 4 and doc["dp_rank"] == 1
    (tmp_path / "control.json.ack.7").write_text("[1, 2]")     # garbage is ignored
    assert {r: d["seq"] for r, d in w.ack_docs().items()} == {1: 1}
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    p2 = w.issue("none", reason="recovered")
    assert ctl.poll() == p2 and p2.seq == 2
    # A restarted tool continues the numbering.
    assert ControlWriter(path).issue("none").seq == 3


@pytest.mark.parametrize("content,why", [
    ("{not json", "Expecting property name"),
    ('{"v": 2, "seq": 5, "strategy": "none"}', "unknown version 2"),
    ('{"v": 1, "seq": 5, "strategy": "explode"}', "unknown strategy"),
    ('{"v": 1, "seq": 5, "strategy": "rebalance_microbatches"}', "needs microbatches"),
    ('{"v": 1, "seq": 5, "strategy": "rebalance_microbatches", "microbatches": {"0": 0}}',
     ">= 1"),
    ('{"v": 1, "seq": 0, "strategy": "none"}', "positive integer"),
    ('{"v": 1, "seq": 5, "strategy": "rebalance_mi', "Unterminated string"),   # half-written
])
def test_bad_documents_keep_the_last_good_plan(tmp_path, caplog, content, why):
    path = tmp_path / "control.json"
    good = ControlWriter(path).issue("rebalance_microbatches", microbatches={0: 3, 1: 5})
    ctl = ControlFile(path)
    assert ctl.poll() == good
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="greyhound.control"):
        assert ctl.poll() is None
    assert ctl.plan == good and ctl.rejected == 1
    assert why in caplog.text and "keeping plan seq 1" in caplog.text
    with pytest.raises((PlanError, ValueError)):
        Plan.from_dict(json.loads(content))


def _hostile(kind: str, path, tmp_path) -> None:
    """Put a hostile document at `path` (already holding a good plan)."""
    if kind == "huge":                     # 4 GiB, sparse: no disk spent
        with open(tmp_path / "huge", "wb") as fh:
            fh.truncate(4 << 30)
        os.replace(tmp_path / "huge", path)
    elif kind == "nested":                 # under the size limit, too deep to parse
        path.write_text("[" * (MAX_DOC_BYTES - 1))
    elif kind == "symlink_to_zero":        # endless bytes, swapped in by rename
        (tmp_path / "link").symlink_to("/dev/zero")
        os.replace(tmp_path / "link", path)
    elif kind == "fifo":                   # an open() that would wait for a writer
        os.mkfifo(tmp_path / "fifo")
        os.replace(tmp_path / "fifo", path)
    elif kind == "grown_past_limit":       # a trailing plan after a megabyte of spaces
        path.write_text(" " * MAX_DOC_BYTES + '{"v": 1, "seq": 9, "strategy": "none"}')


@pytest.mark.parametrize("kind", ["huge", "nested", "symlink_to_zero", "fifo",
                                  "grown_past_limit"])
def test_hostile_control_files_are_refused_in_bounded_time_and_memory(tmp_path, caplog, kind):
    path = tmp_path / "control.json"
    good = ControlWriter(path).issue("rebalance_microbatches", microbatches={0: 3, 1: 5})
    ctl = ControlFile(path, rank=1)
    assert ctl.poll() == good
    _hostile(kind, path, tmp_path)
    (tmp_path / "tool").mkdir()            # the tool reads a trainer's acks the same way
    tool = ControlWriter(tmp_path / "tool" / "control.json")
    _hostile(kind, tmp_path / "tool" / "control.json.ack.1", tmp_path)
    tracemalloc.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="greyhound.control"):
        assert ctl.poll() is None
    assert tool.ack_docs() == {}
    elapsed = time.monotonic() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ctl.plan == good and ctl.rejected == 1
    assert "rejected" in caplog.text and "keeping plan seq 1" in caplog.text
    assert elapsed < 2.0 and peak < 8 * MAX_DOC_BYTES, (elapsed, peak)


def test_a_removed_control_directory_keeps_the_trainers_plan(tmp_path, record_property):
    """The control file's directory removed after a plan was applied (the
    live test of a lost directory, test_faults, makes it read-only): the
    tool's next write fails with an OSError (attach then says so once and
    advises only), its acks read as none, nothing is made again, and the
    trainer keeps the plan it applied."""
    home = tmp_path / "ctl"
    home.mkdir()
    path = home / "control.json"
    w = ControlWriter(path)
    good = w.issue("rebalance_microbatches", microbatches={0: 3, 1: 5})
    ctl = ControlFile(path, rank=1)
    assert ctl.poll() == good
    ctl.ack(good, microbatches=5)
    assert set(w.ack_docs()) == {1}
    shutil.rmtree(home)
    with pytest.raises(OSError):
        w.issue("none", reason="recovered")
    assert w.ack_docs() == {} and w.seq == good.seq
    assert ctl.poll() is None and ctl.plan == good and ctl.rejected == 0
    assert not home.exists()
    record_property("lost", "removed: the write fails (no such directory); the trainer keeps "
                            "its plan")


def test_writer_refuses_symlinks(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    link = tmp_path / "control.json"
    link.symlink_to(target)
    with pytest.raises(PlanError, match="symbolic link"):
        ControlWriter(link)
    with pytest.raises(PlanError, match="symbolic link"):
        atomic_write_json(link, {"x": 1})
    assert target.read_text() == "precious"


def test_loss_scale_keeps_the_global_gradient():
    """4 data-parallel ranks, 32 micro-batches: the gradient DDP produces (sum
    of scaled micro-batch gradients per rank, averaged over ranks) with an
    uneven split equals the even split's within 1e-6."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(32)]
    world = 4

    def ddp_gradient(split):
        assert sum(split) == len(data)
        per_rank, i = [], 0
        for n in split:
            model.zero_grad()
            for x, y in data[i:i + n]:
                loss = torch.nn.functional.mse_loss(model(x), y) * loss_scale(world, len(data))
                loss.backward()
            i += n
            per_rank.append([p.grad.clone() for p in model.parameters()])
        return [sum(g[k] for g in per_rank) / world for k in range(len(per_rank[0]))]

    even = ddp_gradient([8, 8, 8, 8])
    uneven = ddp_gradient([11, 5, 9, 7])
    for a, b in zip(even, uneven):
        assert torch.allclose(a, b, atol=1e-6)
    # And both equal the gradient of the global batch.
    model.zero_grad()
    sum(torch.nn.functional.mse_loss(model(x), y) for x, y in data).div(len(data)).backward()
    for a, p in zip(even, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)
    with pytest.raises(ValueError):
        loss_scale(4, 3)


@pytest.mark.slow
def test_demo_trainer_follows_a_plan(ddp_job, tmp_path):
    """A real 2-rank gloo DDP job applies a rebalancing plan between steps,
    acknowledges it, and keeps the global batch."""
    from conftest import wait_for
    path = tmp_path / "control.json"
    job = ddp_job(2, 0, "--control-file", str(path), "--microbatches", "4", go=False)
    wait_for(lambda: len(job.truth_records()) >= 10, 120, "the job to train")
    w = ControlWriter(path)
    plan = w.issue("rebalance_microbatches", microbatches={0: 6, 1: 2}, reason="test")
    wait_for(lambda: {r: d["seq"] for r, d in w.ack_docs().items()} == {0: plan.seq, 1: plan.seq},
             60, "both ranks to ack")
    wait_for(lambda: [r for r in job.truth_records() if r["microbatches"] != 4], 60, "new counts")
    after = [r for r in job.truth_records() if r["microbatches"] != 4]
    assert {r["rank"]: r["microbatches"] for r in after} == {0: 6, 1: 2}
    # A plan that does not keep the global batch (8) is not applied.
    w.issue("rebalance_microbatches", microbatches={0: 1, 1: 1}, reason="bad total")
    n = len(job.truth_records())
    wait_for(lambda: len(job.truth_records()) > n + 6, 60, "more steps")
    late = job.truth_records()[-4:]
    assert {r["microbatches"] for r in late if r["rank"] == 0} == {6}
