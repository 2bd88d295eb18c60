"""The live tests' own rule for when a job is settled enough to inject a
fault into (conftest.Tracer.healthy_baseline): the job slowdown in progress
starts where the host's episode started, not at its latest flap."""
from harness import episode_onset


def _change(kind: str, t_s: float) -> dict:
    return {"kind": kind, "scope": "job", "time_ns": int(t_s * 1e9)}


def test_a_host_that_flaps_is_one_episode_from_its_first_slowdown():
    # The job-scope changes of the CI run whose healthy phase timed out
    # (test_kill_9_of_attach_during_a_validation_pause): recoveries of a
    # fraction of a second between slowdowns, for 90 s.
    flaps = [_change("slowdown", 5.03), _change("slowdown", 29.33),
             _change("slowdown", 35.59), _change("recovery", 35.98),
             _change("slowdown", 36.19), _change("recovery", 60.1),
             _change("slowdown", 62.0), _change("slowdown", 88.15)]
    assert episode_onset(flaps, 10.0) == int(5.03e9)
    # A recovery that lasted longer than the gap ends the episode before it.
    assert episode_onset(flaps, 1.5) == int(62.0e9)
    assert episode_onset(flaps, 0.1) == int(62.0e9)
    # One slowdown is its own onset; one after a long recovery starts anew.
    assert episode_onset([_change("slowdown", 3.0)], 10.0) == int(3e9)
    assert episode_onset([_change("slowdown", 3.0), _change("recovery", 4.0),
                          _change("slowdown", 40.0)], 10.0) == int(40e9)
