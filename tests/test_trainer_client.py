"""mitigation.distributed on real gloo DDP jobs: ranks that read a plan at
different steps still apply it at the same step, the global batch holds at
every step, the parameters stay identical on every rank, and the three
examples (plain PyTorch, Accelerate, Megatron-style) follow a plan; the
corpus's other job shapes (examples/fsdp_gloo.py, transformer_accum.py,
checkpoint_eval.py, varlen_lm.py, powersgd_cnn.py, bucketed_mlp.py) run."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from harness import BIN, ROOT, free_port, kill_tree, read_jsonl, wait_for
from mitigation.control import ControlWriter


def torchrun(tmp_path, nproc: int, script, *args: str) -> subprocess.Popen:
    out = open(tmp_path / f"{script.stem}.out", "w")
    return subprocess.Popen([str(BIN / "torchrun"), "--nproc-per-node", str(nproc),
                             "--master-port", str(free_port()), str(script), *args],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class Ranks:
    """NPROC ranks of a script started with the environment torchrun gives
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT: env:// rendezvous), one process each, their output in
    one file, without the launcher's own second of start-up: for the tests
    of what an example computes, not of how it is launched (the tests that
    follow a plan, and every live test, use torchrun)."""

    def __init__(self, tmp_path, nproc: int, script, *args: str):
        port = str(free_port())
        with open(tmp_path / f"{script.stem}.out", "w") as out:
            self.procs = [subprocess.Popen(
                [str(BIN / "python"), str(script), *args],
                env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r),
                     "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                for r in range(nproc)]

    def wait(self, timeout: float) -> int | None:
        """0 once every rank exited 0; the first failing rank's exit status
        as soon as one fails (as torchrun, which then stops the others); None
        if they still run after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c]
            if failed or None not in codes:
                return failed[0] if failed else 0
            time.sleep(0.05)
        return None

    def kill(self) -> None:
        for p in self.procs:
            kill_tree(p)


def example_module(name: str):
    """examples/NAME.py imported (its helpers: a reference run, its model),
    the examples directory on the path only while it loads."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def by_step(rows: list[dict]) -> dict[int, dict[int, dict]]:
    steps: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        steps[r["step"]][r["rank"]] = r
    return steps


def check_in_step(rows: list[dict], nproc: int, total: int) -> dict[int, dict[int, dict]]:
    """Every complete step: the split sums to the global count, every rank
    applied the same plan, and the parameters are the same everywhere."""
    steps = by_step(rows)
    for step, ranks in sorted(steps.items()):
        if len(ranks) < nproc:
            continue                              # the last step, being written
        assert sum(r["microbatches"] for r in ranks.values()) == total, (step, ranks)
        assert len({r["seq"] for r in ranks.values()}) == 1, (step, ranks)
        params = [r["params"] for r in ranks.values()]
        assert max(params) - min(params) <= 1e-4 * max(1.0, abs(params[0])), (step, ranks)
    return steps


def first_step(steps, seq: int) -> int | None:
    return min((s for s, ranks in steps.items() if any(r["seq"] >= seq for r in ranks.values())),
               default=None)


@pytest.mark.slow
def test_ranks_reading_a_plan_at_different_steps_apply_it_at_the_same_step(tmp_path):
    nproc, total = 3, 12
    template = str(tmp_path / "ctl.{rank}.json")
    log = tmp_path / "steps.jsonl"
    proc = torchrun(tmp_path, nproc, ROOT / "tests" / "targets" / "agree.py", template, str(log))
    writers = [ControlWriter(template.format(rank=r)) for r in range(nproc)]
    try:
        wait_for(lambda: len(read_jsonl(log)) >= 3 * nproc, 120, "the job to train")

        def steps_done() -> int:
            return max((r["step"] for r in read_jsonl(log)), default=-1)

        # Plan 1 reaches rank 0's copy, then rank 1's, then rank 2's, some
        # steps apart: nobody may apply it until the last rank has read it.
        split = {0: 3, 1: 4, 2: 5}
        for r in range(nproc):
            writers[r].issue("rebalance_microbatches", microbatches=split, seq=1)
            if r < nproc - 1:
                at = steps_done()
                wait_for(lambda: steps_done() >= at + 5, 60, "five steps")
                assert all(x["seq"] == 0 for x in read_jsonl(log)), "applied before all read it"
        wait_for(lambda: any(x["seq"] == 1 for x in read_jsonl(log)), 60, "plan 1 applied")
        # Plan 2 reaches ranks 0 and 1 only; plan 3 replaces it everywhere.
        writers[0].issue("rebalance_microbatches", microbatches={0: 6, 1: 3, 2: 3}, seq=2)
        writers[1].issue("rebalance_microbatches", microbatches={0: 6, 1: 3, 2: 3}, seq=2)
        at = steps_done()
        wait_for(lambda: steps_done() >= at + 5, 60, "five steps")
        # Plan 3 reaches rank 2 first: the others hold 2, rank 2 never had
        # it, so neither may apply (the newest everyone read is not one plan).
        split3 = {0: 2, 1: 2, 2: 8}
        writers[2].issue("rebalance_microbatches", microbatches=split3, seq=3)
        at = steps_done()
        wait_for(lambda: steps_done() >= at + 5, 60, "five steps")
        assert all(x["seq"] <= 1 for x in read_jsonl(log)), "applied before all read it"
        for r in (0, 1):
            writers[r].issue("rebalance_microbatches", microbatches=split3, seq=3)
        wait_for(lambda: any(x["seq"] == 3 for x in read_jsonl(log)), 60, "plan 3 applied")
        # A plan for another world (stale): acked, nothing changes.
        for r in range(nproc):
            writers[r].issue("rebalance_microbatches", microbatches={0: 6, 1: 6}, seq=4)
        wait_for(lambda: any(x["seq"] == 4 for x in read_jsonl(log)), 60, "plan 4 acked")
        at = steps_done()
        wait_for(lambda: steps_done() >= at + 2, 60, "two steps")
        (tmp_path / "ctl.stop.json").touch()
        assert proc.wait(timeout=60) == 0
    finally:
        kill_tree(proc)
    rows = read_jsonl(log)
    steps = check_in_step(rows, nproc, total)
    assert not any(x["seq"] == 2 for x in rows)
    s1, s3, s4 = first_step(steps, 1), first_step(steps, 3), first_step(steps, 4)
    for step, seq, want in ((s1, 1, split), (s3, 3, split3), (s4, 4, split3)):
        ranks = steps[step]
        assert {r: ranks[r]["microbatches"] for r in ranks} == want, (seq, ranks)
        assert all(ranks[r]["seq"] == seq for r in ranks)
        before = steps[step - 1]
        assert all(before[r]["seq"] < seq for r in before)
    assert all(r["loss_scale"] == pytest.approx(nproc / total) for r in rows)
    acks = {r: writers[r].ack_docs()[r] for r in range(nproc)}   # each in its own copy's place
    assert all(a["seq"] == 4 for a in acks.values())
    assert {r: a["microbatches"] for r, a in acks.items()} == split3


@pytest.mark.slow
@pytest.mark.parametrize("example,args", [
    ("plain_pytorch", ("--microbatches", "4")),
    ("accelerate_loop", ("--accumulation", "4")),
    ("megatron_style", ("--global-batch", "128", "--micro-batch", "16")),
])
def test_an_example_follows_a_plan(tmp_path, example, args):
    """Each runnable example applies a rebalance on both ranks at one step
    and stays in step (same parameters) with the uneven split."""
    ctl, log = tmp_path / "ctl.json", tmp_path / "steps.jsonl"
    proc = torchrun(tmp_path, 2, ROOT / "examples" / f"{example}.py", "--steps", "40",
                    "--control-file", str(ctl), "--step-log", str(log), *args)
    try:
        wait_for(lambda: len(read_jsonl(log)) >= 4, 120, f"{example} to train")
        announced = ControlWriter(ctl).ack_docs()
        assert {r: a["microbatches"] for r, a in announced.items()} == {0: 4, 1: 4}
        ControlWriter(ctl).issue("rebalance_microbatches", microbatches={0: 6, 1: 2})
        assert proc.wait(timeout=120) == 0, (tmp_path / f"{example}.out").read_text()[-3000:]
    finally:
        kill_tree(proc)
    rows = read_jsonl(log)
    steps = check_in_step(rows, 2, 8)
    assert len(steps) == 40
    first = first_step(steps, 1)
    assert first is not None and first < 40, "the plan was never applied"
    assert {r: x["microbatches"] for r, x in steps[first].items()} == {0: 6, 1: 2}
    acks = ControlWriter(ctl).ack_docs()
    assert {r: (a["seq"], a["microbatches"]) for r, a in acks.items()} == {0: (1, 6), 1: (1, 2)}


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A real one-rank gloo group in this process, its all-reduces counted."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    yield calls
    dist.destroy_process_group()


def test_without_a_control_file_nothing_is_read_or_reduced(one_rank_group, monkeypatch):
    from mitigation.distributed import Greyhound
    monkeypatch.delenv("GREYHOUND_CONTROL_FILE", raising=False)
    gh = Greyhound(None, microbatches=3)
    steps = [gh.step() for _ in range(3)]
    assert [(s.microbatches, s.loss_scale, s.plan) for s in steps] == [(3, 1 / 3, None)] * 3
    assert one_rank_group == []


def test_the_restart_handshake(one_rank_group, tmp_path):
    from mitigation.control import RESTART_EXIT_CODE, read_doc
    from mitigation.distributed import Greyhound
    ctl = tmp_path / "ctl.json"
    gh = Greyhound(ctl, microbatches=2, checkpoint=True)
    assert gh.step().restart is None and len(one_rank_group) == 1
    ControlWriter(ctl).issue("checkpoint_restart", restart={"checkpoint": True, "exclude": [3]})
    s = gh.step()
    assert s.restart is not None and s.restart.seq == 1 and s.plan is None
    assert gh.restart(tmp_path / "ckpt.pt") == RESTART_EXIT_CODE
    req = read_doc(f"{ctl}.restart")
    assert (req["seq"], req["checkpoint"], req["exclude"]) == (1, str(tmp_path / "ckpt.pt"), [3])
    assert read_doc(f"{ctl}.ack.0")["seq"] == 1
    with pytest.raises(RuntimeError):
        gh.restart(tmp_path / "ckpt.pt")             # once per plan


def test_a_trainer_that_cannot_restart_is_not_asked_to(one_rank_group, tmp_path):
    from mitigation.distributed import Greyhound
    ctl = tmp_path / "ctl.json"
    gh = Greyhound(ctl, microbatches=2)
    ControlWriter(ctl).issue("checkpoint_restart", restart={"checkpoint": True})
    s = gh.step()
    assert s.restart is None and s.plan.seq == 1 and s.microbatches == 2
    assert not (tmp_path / "ctl.json.restart").exists()


def assert_replicas_equal_and_training(mine: dict, key: str = "params",
                                       ranks: tuple[int, int] = (0, 1)) -> None:
    """Two ranks' (0 and 1's) checksums `key` equal at each of the 6 steps
    (their replicas kept in step), and different at every step (they train)."""
    a, b = ranks
    for i in range(6):
        assert mine[a, i][key] == pytest.approx(mine[b, i][key], rel=1e-9), (i, key)
    assert len({mine[a, i][key] for i in range(6)}) == 6, key


def assert_pipeline_matches_reference(mine: dict, **shape) -> None:
    """A 2-rank pipeline's 6 steps (the last stage on rank 1) against the
    same model trained in one process (gpipe_pipelining.reference, 4
    micro-batches, the examples' width and context): rank 1's losses step
    by step, the same global gradient norm on both ranks, and every rank's
    parameters moving every step."""
    reference = example_module("gpipe_pipelining").reference
    assert all(mine[0, i]["loss"] is None for i in range(6))
    want = reference(6, dim=128, context=64, microbatches=4, **shape)
    assert [mine[1, i]["loss"] for i in range(6)] == pytest.approx(want, abs=1e-5)
    assert all(mine[0, i]["grad_norm"] == mine[1, i]["grad_norm"] for i in range(6))
    assert len({mine[r, i]["params"] for r in range(2) for i in range(6)}) == 12


@pytest.mark.slow
@pytest.mark.parametrize("example", ["fsdp_gloo", "transformer_accum", "checkpoint_eval",
                                     "varlen_lm", "powersgd_cnn", "bucketed_mlp",
                                     "moe_alltoall", "tensor_data_parallel",
                                     "local_sgd", "zero_ddp", "batch_rampup",
                                     "static_graph", "hsdp_mesh", "pipeline_1f1b",
                                     "toy_ddp", "gan_ddp", "join_lstm",
                                     "clip_contrastive", "ema_rank0", "compiled_ddp",
                                     "ppo_rollout", "vit_checkpoint",
                                     "multitask_unused", "manual_allreduce",
                                     "sparse_recsys", "gossip_sgd", "syncbn_cnn",
                                     "param_server", "ring_attention",
                                     "ulysses_attention", "evolution_strategies",
                                     "topk_compression", "scatter_batches",
                                     "fairseq_legacy", "async_checkpoint", "diloco",
                                     "gpipe_pipelining", "hierarchical_allreduce",
                                     "interleaved_pipelining", "data_mixing", "fednova",
                                     "stale_allreduce", "distill_teacher",
                                     "adaptive_averaging"])
def test_the_held_out_job_shapes_run_and_log_their_iterations(tmp_path, example):
    """The corpus's other job shapes (FSDP2; no_sync accumulation;
    rank 0's checkpoints and periodic evaluation; each rank's own sequence
    lengths; PowerSGD-compressed gradients; many gradient buckets and a
    logging step; experts exchanging tokens all-to-all; tensor and data
    parallelism at once, 4 ranks; post-local SGD; ZeRO-1's sharded
    optimizer and a logging all-reduce; a batch-size ramp-up; DDP's static
    graph with activation checkpointing and gathered metrics; hybrid sharding
    on a 2 x 2 mesh; a 1F1B pipeline, one stage per rank; the DDP
    tutorial's toy model, a millisecond an iteration; a GAN's two DDP
    models in turn; an LSTM language model on uneven shards under DDP's
    Join; CLIP-style contrastive training, features all-gathered in the
    forward; rank 0 alone keeping an EMA of the weights; a DDP model under
    torch.compile; PPO's rollouts then minibatch updates; a vision
    transformer with activation checkpointing; two tasks in turn under
    find_unused_parameters; gradients averaged by hand, an all-reduce per
    parameter; a recommender's sparse embedding gradients; decentralized
    SGD, parameters averaged with ring neighbours; batch norm synced across
    the ranks, collectives in the forward too; a parameter server, rank 0
    stepping the workers' mean gradient; ring attention, key and value
    chunks passed round the ranks in both passes; Ulysses sequence
    parallelism, heads and sequence swapped by all-to-alls; evolution
    strategies, no backward and one all-gather of returns; top-k
    compressed gradients, all-gathered; rank 0's input pipeline scattering
    each rank its shard; fairseq's legacy trainer, batches by tokens,
    accumulation without communication, then the sample size and one flat
    gradient buffer all-reduced; asynchronous checkpoints, saved from a
    background thread on a group of their own; DiLoCo, inner steps with no
    communication, then the pseudo-gradient all-reduced for an outer
    Nesterov step; torch.distributed.pipelining's GPipe schedule, one
    stage per rank; a hierarchical all-reduce, within nodes then between
    their leaders, 4 ranks; the interleaved 1F1B schedule, two stages per
    rank; online data mixing, per-domain losses gathered and rank 0's new
    weights broadcast as objects; FedNova, each client a random number of
    local steps a round, then normalized averaging; gradients all-reduced
    asynchronously and applied a step late; a teacher rank scattering soft
    targets to students trained on a group of their own; local SGD whose
    replicas are averaged when their drift, all-reduced every step, passes
    a threshold) stay runnable: 2
    ranks (or 3, or 4), 6 steps each (6 epochs of 1 and 2 batches for the uneven
    shards), every iteration in the truth log."""
    truth = tmp_path / "truth.jsonl"
    extra = {"checkpoint_eval": ("--ckpt-every", "3", "--eval-every", "4", "--ckpt-mb", "1",
                                 "--ckpt-dir", str(tmp_path)),
             "powersgd_cnn": ("--start-iter", "3"),
             "bucketed_mlp": ("--sync-every", "4"),
             "tensor_data_parallel": ("--checksums",),
             "local_sgd": ("--warmup", "2", "--period", "2", "--checksums"),
             "zero_ddp": ("--log-every", "3", "--checksums"),
             "static_graph": ("--metrics-every", "3", "--checksums"),
             "hsdp_mesh": ("--checksums",),
             "pipeline_1f1b": ("--checksums",),
             "toy_ddp": ("--checksums",),
             "gan_ddp": ("--checksums",),
             "join_lstm": ("--batches", "1", "--extra", "1", "--checksums"),
             "clip_contrastive": ("--checksums",),
             "ema_rank0": ("--checksums",),
             "compiled_ddp": ("--checksums",),
             "ppo_rollout": ("--horizon", "32", "--checksums"),
             "vit_checkpoint": ("--batch", "2", "--log-every", "3", "--checksums"),
             "multitask_unused": ("--log-every", "3", "--checksums"),
             "manual_allreduce": ("--epoch", "3", "--checksums"),
             "gossip_sgd": ("--log-every", "3", "--checksums"),
             "syncbn_cnn": ("--checksums",),
             "param_server": ("--checksums",),
             "ring_attention": ("--checksums", "--chunk", "32"),
             "ulysses_attention": ("--checksums", "--chunk", "32"),
             "evolution_strategies": ("--checksums", "--pairs", "4", "--horizon", "20"),
             "topk_compression": ("--checksums", "--width", "64"),
             "scatter_batches": ("--checksums", "--log-every", "3"),
             "sparse_recsys": ("--users", "600", "--items", "300", "--eval-every", "3",
                               "--checksums"),
             "fairseq_legacy": ("--max-tokens", "256", "--update-freq", "2", "--dim", "64",
                                "--layers", "2", "--checksums"),
             "async_checkpoint": ("--ckpt-every", "1", "--ckpt-dir", str(tmp_path),
                                  "--checksums"),
             "diloco": ("--inner", "3", "--checksums"),
             "gpipe_pipelining": ("--checksums",),
             "hierarchical_allreduce": ("--checksums",),
             "interleaved_pipelining": ("--checksums",),
             "data_mixing": ("--checksums",),
             "fednova": ("--checksums", "--samples", "256"),
             "stale_allreduce": ("--checksums", "--width", "8"),
             "adaptive_averaging": ("--checksums", "--width", "32", "--threshold", "0.024",
                                    "--max-period", "4"),
             "distill_teacher": ("--checksums", "--batch", "64", "--teacher-width", "64",
                                 "--student-width", "32"),
             "batch_rampup": ("--start-mb", "1", "--mb", "3", "--ramp-every", "2",
                              "--checksums")}.get(example, ())
    nproc = 4 if example in ("tensor_data_parallel", "hsdp_mesh",
                             "hierarchical_allreduce") else 3 if example == "distill_teacher" else 2
    ranks = Ranks(tmp_path, nproc, ROOT / "examples" / f"{example}.py", "--steps", "6",
                  "--truth", str(truth), *extra)
    try:
        assert ranks.wait(120) == 0, (tmp_path / f"{example}.out").read_text()[-2000:]
    finally:
        ranks.kill()            # a hung rank is not left behind
    rows = read_jsonl(truth)
    its = sorted((d["rank"], d["index"]) for d in rows if "dur_ns" in d)
    steps = {r: 6 * (1 + r) if example == "join_lstm" else 6 for r in range(nproc)}
    assert its == [(r, i) for r in range(nproc) for i in range(steps[r])]
    assert sorted(d["rank"] for d in rows if d.get("final")) == list(range(nproc))
    mine = {(d["rank"], d["index"]): d for d in rows if "dur_ns" in d}
    if example == "checkpoint_eval":
        # Both ranks log the periodic phases at the same steps; rank 0's
        # last checkpoint is whole (step 5: the second of every 3).
        phases = {(d["rank"], d["index"]): d["phase"] for d in rows if "phase" in d}
        assert [i for i in range(6) if phases[0, i] == "checkpoint"] == [2, 5]
        assert [i for i in range(6) if phases[1, i] == "eval"] == [3]
        import torch
        assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 5
        assert not list(tmp_path.glob("*.tmp"))
    if example == "varlen_lm":
        # Each rank draws its own lengths (the point of the shape), and
        # the language model trains on them.
        tokens = {(d["rank"], d["index"]): d["tokens"] for d in rows if "tokens" in d}
        assert any(tokens[0, i] != tokens[1, i] for i in range(6))
        assert all(4 <= n <= 192 for n in tokens.values())
        assert all(d["loss"] is not None and d["loss"] > 0 for d in rows if "tokens" in d)
    if example == "bucketed_mlp":
        # Several gradient buckets an iteration once DDP has rebuilt them
        # (the first iteration has one), the logging step every 4th, and
        # every rank logs the same mean loss.
        assert all(mine[r, i]["buckets"] >= 3 for r in range(2) for i in range(1, 6))
        assert [i for i in range(6) if mine[0, i].get("synced")] == [3]
        assert all(mine[0, i]["loss"] == mine[1, i]["loss"] for i in range(6))
    if example == "powersgd_cnn":
        # The hook ran at every iteration (3 plain, then compressed).
        assert [d["hook_iter"] for d in rows if d.get("rank") == 0 and "hook_iter" in d] == \
            list(range(1, 7))
    if example == "moe_alltoall":
        # Every token went to some expert: the ranks' experts ran all of
        # them between them, each iteration (no capacity limit, none dropped).
        ran = {}
        for d in rows:
            if "tokens" in d:
                ran[d["index"]] = ran.get(d["index"], 0) + d["tokens"]
        assert ran == {i: 2 * 512 for i in range(6)}, ran
        assert all(d["loss"] > 0 for d in rows if "tokens" in d)
    if example == "tensor_data_parallel":
        # A tensor-parallel pair (0, 1) computes one output: the same loss;
        # the replicas (0 and 2) see their own samples. DDP kept each
        # rank's slices equal to its replica's, and the slices differ.
        assert [(mine[r, 0]["tp_rank"], mine[r, 0]["dp_rank"]) for r in range(4)] == \
            [(0, 0), (1, 0), (0, 1), (1, 1)]
        for i in range(6):
            assert mine[0, i]["loss"] == pytest.approx(mine[1, i]["loss"], abs=1e-6)
            assert mine[2, i]["loss"] == pytest.approx(mine[3, i]["loss"], abs=1e-6)
            assert mine[0, i]["params"] == pytest.approx(mine[2, i]["params"], rel=1e-9)
            assert mine[1, i]["params"] == pytest.approx(mine[3, i]["params"], rel=1e-9)
            assert mine[0, i]["params"] != pytest.approx(mine[1, i]["params"], rel=1e-6)
        assert any(mine[0, i]["loss"] != mine[2, i]["loss"] for i in range(6))
    if example == "local_sgd":
        # DDP for the 2 warm-up steps (the replicas stay equal), then local
        # steps: the replicas drift apart on their own samples, and are
        # equal again after every second step's averaging.
        assert [mine[0, i]["averaged"] for i in range(6)] == [False, False, True, False,
                                                               True, False]
        for i in (0, 1, 2, 4):
            assert mine[0, i]["params"] == pytest.approx(mine[1, i]["params"], rel=1e-9), i
        assert any(mine[0, i]["params"] != pytest.approx(mine[1, i]["params"], rel=1e-7)
                   for i in (3, 5))
    if example == "zero_ddp":
        # Each rank's optimizer holds its own shard, the shards cover every
        # parameter tensor once, and the broadcasts after each step keep the
        # ranks' parameters equal (the step changes them); the loss is
        # all-reduced every third step.
        shards = [mine[r, 0]["shard"] for r in range(2)]
        assert all(shards) and sum(shards) == mine[0, 0]["tensors"], shards
        assert [i for i in range(6) if mine[0, i]["logged"]] == [2, 5]
        assert_replicas_equal_and_training(mine)
    if example == "batch_rampup":
        # One micro-batch more every second iteration up to 3, and DDP keeps
        # the replicas equal through the accumulation (and they train).
        assert [mine[0, i]["microbatches"] for i in range(6)] == [1, 1, 2, 2, 3, 3]
        assert_replicas_equal_and_training(mine)
    if example == "static_graph":
        # Every third step each rank received every rank's metrics (and on
        # no other step), and DDP's static graph, with the blocks recomputed
        # in backward, keeps the replicas equal as they train.
        for r in range(2):
            assert [mine[r, i]["gathered"] for i in range(6)] == [[], [], [0, 1], [], [],
                                                                   [0, 1]]
        assert_replicas_equal_and_training(mine)
        assert mine[0, 0]["loss"] != mine[1, 0]["loss"]
    if example == "hsdp_mesh":
        # A 2 x 2 mesh: the ranks of a replica hold different shards, the
        # same shard in the two replicas stays equal (the all-reduce across
        # them), and the model trains on each rank's own samples.
        assert [(mine[r, 0]["replica"], mine[r, 0]["shard"]) for r in range(4)] == \
            [(0, 0), (0, 1), (1, 0), (1, 1)]
        for i in range(6):
            assert mine[0, i]["params"] == pytest.approx(mine[2, i]["params"], rel=1e-9), i
            assert mine[1, i]["params"] == pytest.approx(mine[3, i]["params"], rel=1e-9), i
            assert mine[0, i]["params"] != pytest.approx(mine[1, i]["params"], rel=1e-6), i
        assert len({mine[0, i]["params"] for i in range(6)}) == 6
        assert len({mine[r, 0]["loss"] for r in range(4)}) == 4
    if example == "pipeline_1f1b":
        # Two stages, each with its half of the blocks; the pipeline's
        # losses (the last stage's) and global gradient norms are the ones
        # the same model trained in one process has, step by step, so the
        # 1F1B schedule carried every activation and gradient to its place.
        reference = example_module("pipeline_1f1b").reference
        assert [(mine[r, 0]["stage"], mine[r, 0]["blocks"]) for r in range(2)] == [(0, 3),
                                                                                 (1, 3)]
        assert all(mine[0, i]["loss"] is None for i in range(6))
        want = reference(6, width=128, depth=6, microbatches=6, mb_size=32)
        assert [mine[1, i]["loss"] for i in range(6)] == pytest.approx(want, abs=1e-5)
        assert all(mine[0, i]["grad_norm"] == mine[1, i]["grad_norm"] for i in range(6))
        assert len({mine[r, i]["params"] for r in range(2) for i in range(6)}) == 12
    if example == "toy_ddp":
        # DDP keeps the replicas equal as they step on their own samples.
        assert_replicas_equal_and_training(mine)
        assert mine[0, 0]["loss"] != mine[1, 0]["loss"]
    if example == "gan_ddp":
        # Both models' replicas stay equal as they step (the generator's
        # gradients all-reduced through the unsynced discriminator), each
        # rank on its own images, and both models train.
        assert_replicas_equal_and_training(mine, "params_g")
        assert_replicas_equal_and_training(mine, "params_d")
        assert mine[0, 0]["loss"] != mine[1, 0]["loss"]
    if example == "join_lstm":
        # Rank 1 trains alone on its second batch of every epoch (rank 0,
        # out of data, shadows its all-reduces under Join): the replicas
        # part there, and Join's end of the epoch makes them one again.
        assert [mine[1, i]["epoch"] for i in range(12)] == [e for e in range(6) for _ in "ab"]
        for e in range(6):
            assert mine[0, e]["epoch"] == e
            assert mine[0, e]["params"] == pytest.approx(mine[1, 2 * e]["params"], rel=1e-9), e
        assert len({mine[1, i]["params"] for i in range(12)}) == 12
        assert mine[1, 11]["loss"] < mine[1, 0]["loss"]
    if example == "clip_contrastive":
        # The replicas stay equal, each rank contrasts its own pairs (its
        # loss and accuracy its own), and the two encoders learn to match
        # them.
        assert_replicas_equal_and_training(mine)
        assert mine[0, 0]["loss"] != mine[1, 0]["loss"]
        assert all(mine[r, 5]["loss"] < mine[r, 0]["loss"] for r in range(2))
    if example == "ema_rank0":
        # The replicas stay equal; rank 0 alone keeps the moving average,
        # which trails the model (its decay ramps up from 0: at first it
        # follows the model closely, never onto it).
        assert_replicas_equal_and_training(mine)
        assert all("ema" in mine[0, i] and "ema" not in mine[1, i] for i in range(6))
        assert len({mine[0, i]["ema"] for i in range(6)}) == 6
        assert all(mine[0, i]["ema"] != pytest.approx(mine[0, i]["params"], rel=1e-12)
                   for i in range(6))
    if example == "compiled_ddp":
        # Dynamo compiled the DDP model on every rank before the first step
        # ended; the compiled replicas stay equal and learn.
        assert all(mine[r, i]["graphs"] >= 1 for r in range(2) for i in range(6))
        assert_replicas_equal_and_training(mine)
        assert all(mine[r, 5]["loss"] < mine[r, 0]["loss"] for r in range(2))
    if example == "ppo_rollout":
        # Each rank rolls out first (a share of the iteration without a
        # collective), the replicas stay equal under the minibatch updates,
        # and the episodes' returns are all-reduced (the same on every rank).
        assert_replicas_equal_and_training(mine)
        assert all(0 < mine[r, i]["rollout_ns"] < mine[r, i]["dur_ns"]
                   for r in range(2) for i in range(6))
        assert [mine[0, i]["return"] for i in range(6)] == [mine[1, i]["return"]
                                                           for i in range(6)]
        assert mine[0, 0]["return"] > 1      # a random policy's episodes end within it
    if example == "vit_checkpoint":
        # The checkpointed replicas stay equal and learn; the loss all-reduced
        # for the log (steps 2 and 5) is the ranks' mean, the same on each.
        assert_replicas_equal_and_training(mine)
        assert [mine[r, i]["logged_loss"] for r in range(2) for i in (0, 1)] == [None] * 4
        for i in (2, 5):
            assert mine[0, i]["logged_loss"] == mine[1, i]["logged_loss"] == pytest.approx(
                (mine[0, i]["loss"] + mine[1, i]["loss"]) / 2, abs=1e-3)
    if example == "multitask_unused":
        # The tasks take turns; the replicas stay equal although each step
        # leaves one head unused (DDP finds it), and the logged losses are
        # the ranks' means, the same on each.
        assert_replicas_equal_and_training(mine)
        assert [mine[0, i]["task"] for i in range(6)] == ["classify", "regress"] * 3
        assert mine[0, 2]["logged"] == mine[1, 2]["logged"] == pytest.approx(
            [(mine[0, 2 - i]["loss"] + mine[1, 2 - i]["loss"]) / 2
             for i in range(2)], abs=1e-5)    # classify at step 2, regress at 1
    if example == "manual_allreduce":
        # Averaged by hand, the replicas stay equal; the epoch's loss (steps
        # 0-2) all-reduced at its end is the ranks' mean, the same on each.
        assert_replicas_equal_and_training(mine)
        assert mine[0, 1]["epoch_loss"] is None
        assert mine[0, 2]["epoch_loss"] == mine[1, 2]["epoch_loss"] == pytest.approx(
            sum(mine[r, i]["loss"] for r in range(2) for i in range(3)) / 6, abs=1e-5)
    if example == "sparse_recsys":
        # The tables' sparse gradients, gathered from every rank, keep the
        # replicas equal; the hit rate (step 2, every rank's users) is one.
        assert_replicas_equal_and_training(mine)
        assert mine[0, 1]["hit_rate"] is None
        assert mine[0, 2]["hit_rate"] == mine[1, 2]["hit_rate"]
        assert 0 <= mine[0, 2]["hit_rate"] <= 1
    if example == "gossip_sgd":
        # No all-reduce of gradients: each rank keeps its own replica, and
        # averaging with its neighbour (the only one with 2 ranks) after
        # every step holds the two within rounding. The mean loss (steps 2
        # and 5) is the only collective, the same on both ranks.
        for i in range(6):
            assert mine[0, i]["params"] == pytest.approx(mine[1, i]["params"], rel=1e-6)
        assert len({mine[0, i]["params"] for i in range(6)}) == 6
        assert mine[0, 1]["mean_loss"] is None
        assert mine[0, 2]["mean_loss"] == mine[1, 2]["mean_loss"] == pytest.approx(
            (mine[0, 2]["loss"] + mine[1, 2]["loss"]) / 2, abs=1e-5)
    if example == "syncbn_cnn":
        # DDP keeps the replicas equal; the batch norms' running statistics
        # are equal too although each rank's images differ (each one's own
        # brightness) and DDP broadcasts no buffer: they are the global
        # batch's, synced in every forward. They change at every step.
        assert_replicas_equal_and_training(mine)
        assert_replicas_equal_and_training(mine, "stats")
    if example == "param_server":
        # Rank 0 serves and trains nothing; the worker's pull leaves its
        # parameters equal to the server's after every step, and they change.
        assert [mine[r, 0]["role"] for r in range(2)] == ["server", "worker"]
        assert all(mine[0, i]["loss"] is None and mine[1, i]["loss"] > 0 for i in range(6))
        assert_replicas_equal_and_training(mine)
    if example == "ring_attention":
        # The ring's attention is attention over the whole sequence (output
        # and gradients, on each rank's chunk), and DDP keeps the replicas
        # equal.
        assert all(mine[r, 0]["ring_error"] < 1e-9 for r in range(2))
        assert_replicas_equal_and_training(mine)
    if example == "ulysses_attention":
        # The exchanged attention is attention over the whole sequence
        # (output and gradients, on each rank's chunk), and DDP keeps the
        # replicas equal.
        assert all(mine[r, 0]["ulysses_error"] < 1e-9 for r in range(2))
        assert_replicas_equal_and_training(mine)
    if example == "evolution_strategies":
        # Every rank applies the same update from every rank's returns, so
        # the replicas stay equal; the population's returns differ from
        # step to step.
        assert_replicas_equal_and_training(mine)
        assert len({mine[0, i]["loss"] for i in range(6)}) == 6
    if example == "topk_compression":
        # Every rank sums every rank's top entries into the same update.
        assert_replicas_equal_and_training(mine)
    if example == "scatter_batches":
        # Each rank trains on its own shard of rank 0's batch (their losses
        # differ), DDP keeps the replicas equal, and the loss all-reduced
        # for the log every 3 steps is the ranks' mean.
        assert_replicas_equal_and_training(mine)
        assert all(mine[0, i]["loss"] != mine[1, i]["loss"] for i in range(6))
        for i in (2, 5):
            mean = (mine[0, i]["loss"] + mine[1, i]["loss"]) / 2
            assert mine[0, i]["logged_loss"] == mine[1, i]["logged_loss"] \
                == pytest.approx(mean, abs=1e-5), i
        assert mine[0, 1]["logged_loss"] is None and mine[1, 4]["logged_loss"] is not None
    if example == "fairseq_legacy":
        # Each rank draws its own batches by tokens (their counts differ);
        # the sample size all-reduced is the job's, the same on each, and
        # the flat buffer's gradients keep the replicas equal.
        assert_replicas_equal_and_training(mine)
        assert any(mine[0, i]["tokens"] != mine[1, i]["tokens"] for i in range(6))
        for i in range(6):
            assert mine[0, i]["job_tokens"] == mine[1, i]["job_tokens"] \
                == mine[0, i]["tokens"] + mine[1, i]["tokens"], i
            assert mine[0, i]["loss"] == mine[1, i]["loss"], i
    if example == "diloco":
        # Each rank trains on its own data between outer steps (its losses
        # its own); the pseudo-gradient is the ranks' mean (the same on
        # each), and the global parameters they agree on move every step.
        assert_replicas_equal_and_training(mine)
        for i in range(6):
            assert mine[0, i]["loss"] != mine[1, i]["loss"], i
            assert mine[0, i]["pseudo_norm"] == mine[1, i]["pseudo_norm"] > 0, i
        assert mine[0, 5]["loss"] < mine[0, 0]["loss"]
    if example == "gpipe_pipelining":
        # Two stages, each with its half of the layers (the embeddings on
        # the first, the head on the last); the schedule's losses (the
        # last stage's) and the global gradient norms are the ones the
        # same model trained in one process has, step by step, so the
        # library's sends carried every activation and gradient to its
        # place, and both stages step.
        assert [(mine[r, 0]["stage"], mine[r, 0]["layers"]) for r in range(2)] == [(0, 3),
                                                                                 (1, 3)]
        assert_pipeline_matches_reference(mine, depth=6, batch_size=16, stages=2)
    if example == "hierarchical_allreduce":
        # Two nodes of two, each led by its first rank; the four replicas
        # stay equal as they step, each on its own samples, and the
        # gradient they step on is the mean of the four ranks' own (step
        # 0's recomputed here in one process): the reduce, the leaders'
        # all-reduce and the broadcast carried every rank's share.
        hier = example_module("hierarchical_allreduce")
        assert [(mine[r, 0]["node"], mine[r, 0]["leader"]) for r in range(4)] == \
            [(0, True), (0, False), (1, True), (1, False)]
        for i in range(6):
            assert len({mine[r, i]["params"] for r in range(4)}) == 1, i
            assert len({mine[r, i]["grad_norm"] for r in range(4)}) == 1, i
        assert len({mine[0, i]["params"] for i in range(6)}) == 6
        assert len({mine[r, 0]["loss"] for r in range(4)}) == 4
        import torch
        import torch.nn.functional as F
        net, grads = hier.model(16, 0), []
        for r in range(4):
            x, y = hier.batch(torch.Generator().manual_seed(1000 * r), 32)
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in net.parameters()]))
        assert mine[0, 0]["grad_norm"] == pytest.approx(float((sum(grads) / 4).norm()),
                                                        rel=1e-5)
    if example == "interleaved_pipelining":
        # Four stages on two ranks, rank 0 holding the first and the third
        # (so the micro-batches go round the ranks twice), one layer each;
        # the losses (the last stage's, on rank 1) and the global gradient
        # norms are those of the same model trained in one process, step
        # by step: every activation and gradient reached its stage.
        assert [(mine[r, 0]["stages"], mine[r, 0]["layers"]) for r in range(2)] == \
            [([0, 2], 2), ([1, 3], 2)]
        assert_pipeline_matches_reference(mine, depth=4, batch_size=12, stages=4)
    if example == "data_mixing":
        # The replicas train in step; every rank gathered the same
        # per-domain losses (each rank's own in its place, the ranks'
        # differing) and sampled by the same weights; rank 0's update of
        # them, recomputed here from the gathered losses step by step, is
        # the weights every rank sampled the next step by.
        assert_replicas_equal_and_training(mine)
        update = example_module("data_mixing").update
        import math
        weights, reference = [0.25] * 4, [math.log(8)] * 4
        for i in range(6):
            assert mine[0, i]["losses"] == mine[1, i]["losses"], i
            assert mine[0, i]["losses"][0] != mine[0, i]["losses"][1], i
            assert mine[0, i]["weights"] == mine[1, i]["weights"] \
                == pytest.approx(weights, rel=1e-12), i
            weights, reference = update(weights, mine[0, i]["losses"], reference)
        assert sum(weights) == pytest.approx(1.0) and weights != [0.25] * 4
    if example == "fednova":
        # Each client its own random number of local steps a round (drawn
        # as local_steps says), its own data and losses; the weighted mean
        # step count and the global model are the same on both, and round
        # 0's global model is FedNova's normalized average of the two
        # clients' local runs, recomputed here in one process.
        assert_replicas_equal_and_training(mine, "params")
        fed = example_module("fednova")
        share = [fed.samples(r, 256) / (fed.samples(0, 256) + fed.samples(1, 256))
                 for r in range(2)]
        for i in range(6):
            taus = [mine[r, i]["tau"] for r in range(2)]
            assert taus == [fed.local_steps(0, i, r, 2, 8) for r in range(2)], i
            assert [mine[r, i]["share"] for r in range(2)] == pytest.approx(share)
            assert mine[0, i]["tau_eff"] == mine[1, i]["tau_eff"] == pytest.approx(
                share[0] * taus[0] + share[1] * taus[1]), i
            assert mine[0, i]["loss"] != mine[1, i]["loss"], i
        assert any(mine[0, i]["tau"] != mine[1, i]["tau"] for i in range(6))
        import torch
        import torch.nn.functional as F
        start = [q.detach().clone() for q in fed.model(256, 0).parameters()]
        moved, taus = [], [mine[r, 0]["tau"] for r in range(2)]
        for r in range(2):
            net = fed.model(256, 0)
            x, y = fed.client_data(r, fed.samples(r, 256), 0)
            order, opt = torch.Generator().manual_seed(7 + r), torch.optim.SGD(
                net.parameters(), lr=0.05)
            for _ in range(taus[r]):
                pick = torch.randint(0, len(y), (128,), generator=order)
                opt.zero_grad()
                F.cross_entropy(net(x[pick]), y[pick]).backward()
                opt.step()
            moved.append([(g - q.detach()) * share[r] / taus[r]
                          for g, q in zip(start, net.parameters())])
        tau_eff = share[0] * taus[0] + share[1] * taus[1]
        glob = [g - tau_eff * (a + b) for g, a, b in zip(start, *moved)]
        assert mine[0, 0]["params"] == pytest.approx(
            float(sum(g.double().sum() for g in glob)), rel=1e-5)
    if example == "stale_allreduce":
        # Step t applies step t - 1's averaged gradients (step 0 nothing:
        # its parameters are the initial ones); the replicas stay equal
        # and move from step 1 on, and step 1's move is the mean of the
        # two ranks' step-0 gradients, recomputed here in one process.
        st = example_module("stale_allreduce")
        assert [mine[0, i]["applied"] for i in range(6)] == [None, 0, 1, 2, 3, 4]
        init = st.model(8, 0)
        assert mine[0, 0]["params"] == mine[1, 0]["params"] == pytest.approx(
            float(sum(q.detach().double().sum() for q in init.parameters())), rel=1e-9)
        assert_replicas_equal_and_training(mine)
        assert mine[0, 0]["grad"] != mine[1, 0]["grad"]
        import torch
        import torch.nn.functional as F
        grads = []
        for r in range(2):
            net = st.model(8, 0)
            x, y = st.batch(torch.Generator().manual_seed(1000 * r), 64)
            F.cross_entropy(net(x), y).backward()
            grads.append(sum(float(q.grad.double().sum()) for q in net.parameters()))
        assert [mine[r, 0]["grad"] for r in range(2)] == pytest.approx(grads, rel=1e-5)
        assert mine[0, 1]["params"] - mine[0, 0]["params"] == pytest.approx(
            -0.2 * (grads[0] + grads[1]) / 2, rel=1e-3)
    if example == "adaptive_averaging":
        # The ranks agree at every step whether to average, by the rule
        # (their mean drift over the threshold, or 4 steps since the last
        # average), from the drifts they logged; both ways come up in 6
        # steps. An average is the mean of the two replicas (its checksum
        # the mean of theirs) and equal on both; between averages the
        # replicas part.
        since, seen = 0, set()
        for i in range(6):
            since += 1
            mean = (mine[0, i]["drift"] + mine[1, i]["drift"]) / 2
            want = mean > 0.024 or since >= 4
            assert mine[0, i]["averaged"] == mine[1, i]["averaged"] == want, (i, mean)
            seen.add(want)
            if want:
                since = 0
                assert mine[0, i]["params"] == pytest.approx(mine[1, i]["params"], rel=1e-9)
                assert mine[0, i]["params"] == pytest.approx(
                    (mine[0, i]["local"] + mine[1, i]["local"]) / 2, rel=1e-6), i
            else:
                assert [mine[r, i]["params"] for r in range(2)] == [
                    mine[r, i]["local"] for r in range(2)]
                assert mine[0, i]["params"] != mine[1, i]["params"], i
        assert seen == {True, False}
    if example == "distill_teacher":
        # Rank 0 only teaches: it sends each step what the two students
        # receive. The students' replicas stay equal and train, and step 0
        # is recomputed here in one process: the teacher's soft targets for
        # each student's batch, each student's loss, and the SGD step on
        # the mean of their gradients (DDP over the students alone).
        assert all(mine[0, i]["role"] == "teacher" and mine[0, i]["loss"] is None
                   for i in range(6))
        for i in range(6):
            assert mine[0, i]["targets"] == pytest.approx(
                mine[1, i]["targets"] + mine[2, i]["targets"], rel=1e-5, abs=1e-3), i
            assert mine[1, i]["loss"] != mine[2, i]["loss"], i
        assert_replicas_equal_and_training(mine, ranks=(1, 2))
        import torch
        kd = example_module("distill_teacher")
        teacher, net = kd.teacher(64, 0), kd.student(32, 0)
        losses = []
        for s in (1, 2):
            x, y = kd.batch(kd.data(0, s), 64)
            logits = net(x)
            # Hinton et al.'s loss written out: T^2 KL(teacher || student)
            # at T = 2, weighted 0.7, and 0.3 of the labels' cross-entropy.
            p_t = torch.softmax(teacher(x) / 2, dim=1)
            log_s = torch.log_softmax(logits / 2, dim=1)
            kl = (p_t * (p_t.log() - log_s)).sum(dim=1).mean() * 4
            ce = -torch.log_softmax(logits, dim=1)[torch.arange(64), y].mean()
            loss = 0.7 * kl + 0.3 * ce
            (loss / 2).backward()           # gradients accumulate: their mean
            losses.append(loss.item())
        assert [mine[s, 0]["loss"] for s in (1, 2)] == pytest.approx(losses, abs=2e-6)
        with torch.no_grad():
            after = sum(float((q - 0.1 * q.grad).double().sum()) for q in net.parameters())
        assert mine[1, 0]["params"] == pytest.approx(after, rel=1e-6)
    if example == "async_checkpoint":
        # A save begun every step, the two latest finished ones kept beside
        # the last; that one holds the model of the step that began it.
        assert_replicas_equal_and_training(mine)
        assert [mine[0, i]["saved"] for i in range(6)] == list(range(6))
        assert sorted(d.name for d in tmp_path.glob("step-*")) == ["step-3", "step-4", "step-5"]
        import torch.distributed.checkpoint as dcp
        ckpt = example_module("async_checkpoint")
        net = ckpt.model(256, 4)
        state = {"model": net.state_dict(), "step": -1}
        import warnings
        with warnings.catch_warnings():     # (that it loads in one process: as asked)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
        net.load_state_dict(state["model"])
        assert state["step"] == 5 and ckpt.checksum(net) == pytest.approx(mine[0, 5]["params"])
