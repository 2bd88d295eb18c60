"""The scenario corpus (tests/scenarios, recorded for real by
scripts/record_scenario.py) replayed through JobAnalysis, with its verdicts
pinned against what was done: the right rank and cause named where the
scenario expects it, never a wrong one, no plan outside a fault, every rank
seen once. Runs without root or BPF: the recordings hold every input.

Held-out scenarios (no rule is tuned on them) are pinned on what the design
promises, not on what a tuning run saw; scripts/bench_scenarios reports
their figures apart. One that misses it and is kept held out (not tuned on
yet) says so in corpus.toml (`miss`): its test is then a strict xfail,
listed in every run's summary, that fails once the scenario passes."""
import pytest

import corpus

ALL = corpus.names()


@pytest.fixture(scope="module")
def scored(request):
    """Every scenario this run's tests ask for, replayed once, side by side
    on the machine's cores when the first of them runs."""
    wanted = set()
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and "name" in spec.params:
            wanted.add(spec.params["name"])
    cache = corpus.score_all(sorted(wanted))

    def get(name):
        if name not in cache:
            cache.update([corpus.score_one(name)])
        if isinstance(cache[name], str):
            pytest.fail(f"replaying {name} raised:\n{cache[name]}")
        return cache[name]
    return get


def test_the_corpus_covers_what_it_must():
    kinds = {(f["kind"], f["start_ns"] < t["attached_ns"])
             for t in map(corpus.truth, ALL) for f in t["faults"]}
    assert {("compute", False), ("compute", True), ("link", False)} <= kinds
    assert any(not corpus.truth(n)["faults"] for n in ALL)          # healthy jobs
    assert corpus.names("heldout") and corpus.names("tune")


@pytest.mark.parametrize("name", ALL)
def test_no_wrong_verdict_and_no_plan_outside_a_fault(name, scored):
    r = scored(name)
    assert r["wrong"] == 0, [(d["evidence"], d["cause"], d["ranks"], d["reason"])
                             for d in r["wrong_verdicts"]]
    assert r["plans_outside"] == 0


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=corpus.known_miss(n, "miss_ranks")))
    if corpus.known_miss(n, "miss_ranks") else n for n in ALL])
def test_each_rank_once(name, scored):
    t = corpus.truth(name)
    assert scored(name)["ranks"] == list(range(t["nproc"]))


def _missed(name):
    why = corpus.known_miss(name)
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=why)) if why else name


@pytest.mark.parametrize("name", [_missed(n) for n in ALL if corpus.truth(n)["faults"]])
def test_the_fault_is_named(name, scored):
    r = scored(name)
    for f, expect in zip(r["faults"], corpus.expectations(name), strict=True):
        if expect.get("passive", True):
            assert f["passive_s"] is not None, f
            if "passive_within_s" in expect:
                assert f["passive_s"] <= expect["passive_within_s"], f
        if expect.get("validated", True):
            assert f["validated_s"] is not None, f


@pytest.mark.parametrize("name", [n for n in ALL if not corpus.truth(n)["faults"]])
def test_a_healthy_job_gets_no_named_verdict(name, scored):
    r = scored(name)
    assert r["right"] == 0 and r["wrong"] == 0 and r["plans_in_fault"] == 0


def test_replay_is_deterministic_across_processes():
    # A set or dict whose order depended on string hashing would show here:
    # another interpreter has another hash seed.
    import json
    import subprocess
    import sys
    name = next(n for n in ALL if corpus.truth(n)["faults"])
    code = ("import sys, json; sys.path.insert(0, 'tests'); import corpus; "
            f"print(json.dumps([e for e in corpus.replay({name!r}) if e['kind'] != 'iteration']))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=corpus.SCENARIOS.parents[1], check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}).stdout
            for seed in (1, 2)]
    assert outs[0] == outs[1] and json.loads(outs[0])


def _ranks_log(paces: dict[int, list[float]], n: int) -> list[dict]:
    """Truth records of ranks whose start-to-start times (ms) cycle
    through `paces[rank]` for n iterations each."""
    out = []
    for rank, cycle in paces.items():
        at = 1_000_000_000
        for i in range(n):
            out.append({"rank": rank, "index": i, "start_ns": at})
            at += int(cycle[i % len(cycle)] * 1e6)
    return out


def test_the_job_log_check_reads_every_ranks_pace():
    """`confirmed` reads every rank's log (corpus.job_log): a server whose
    loop top reads 10, 20 and 30 ms around its workers' steady 20 keeps its
    median at 20 when the job slows 8% (its long reads longer), where each
    worker's log shows the 8%; a slowdown no rank's log shows stays
    unconfirmed."""
    from harness import unconfirmed_slowdowns
    healthy = {0: [10.0, 20.0, 30.0], 1: [20.0], 2: [20.0]}
    slower = {0: [10.0, 20.0, 34.8], 1: [21.6], 2: [21.6]}
    n = 300
    before = _ranks_log(healthy, n)
    onset = 1_000_000_000 + int(n * 20e6)
    after = [dict(r, start_ns=r["start_ns"] + onset - 1_000_000_000)
             for r in _ranks_log(slower, n)]
    e = {"kind": "slowdown", "scope": "job", "onset_ns": onset,
         "baseline_ns": onset - int(1e9), "time_ns": onset + int(1e9),
         "before_ms": 20.0, "after_ms": 21.6}
    rank0 = [r for r in before + after if r["rank"] == 0]
    assert unconfirmed_slowdowns([e], rank0) == [e]      # the server alone misses it
    assert unconfirmed_slowdowns([e], before + after) == []
    flat = before + [dict(r, start_ns=r["start_ns"] + int(n * 20e6)) for r in before]
    assert unconfirmed_slowdowns([e], flat) == [e]
