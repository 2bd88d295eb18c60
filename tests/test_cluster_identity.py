"""Who is who across nodes (issue #14): the job's name from a rank's
environment, stream names that cannot smuggle a key pattern, and the census
of ranks the agents announce."""
import pytest

from greyhound_bpf.cluster.identity import (IdentityError, census, commands_stream,
                                            events_stream, job_identity)


def test_the_job_is_named_as_its_launcher_names_it():
    env = {"TORCHELASTIC_RUN_ID": "run7", "SLURM_JOB_ID": "123", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    assert job_identity(env) == "run7"
    # torchrun's default run id names nothing: Slurm's job next.
    assert job_identity({**env, "TORCHELASTIC_RUN_ID": "none"}) == "123"
    assert job_identity({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == \
        "10.0.0.1-29500"
    assert job_identity({"MASTER_ADDR": "node-a"}) is None
    assert job_identity({}) is None
    # A value with characters a key pattern reads is made safe.
    assert job_identity({"TORCHELASTIC_RUN_ID": "a*b:{c}"}) == "a_b__c_"
    assert job_identity({"SLURM_JOB_ID": "_x"}) == "j_x"


def test_stream_names_refuse_what_a_key_pattern_would_read():
    assert events_stream("run7", "node-1") == "gh:run7:ev:node-1"
    assert commands_stream("run7") == "gh:run7:cmd"
    for bad in ("a*", "a:b", "", "-x", "a b", "x" * 101, "n[1]"):
        with pytest.raises(IdentityError, match="letters, digits"):
            events_stream("run7", bad)
    with pytest.raises(IdentityError, match="job"):
        commands_stream("run?")


def test_the_census_wants_every_rank_once():
    two = {"a": [{"rank": 0, "world_size": 4}, {"rank": 1, "world_size": 4}],
           "b": [{"rank": 2, "world_size": 4}, {"rank": 3, "world_size": 4}]}
    assert census(two).complete and census(two).problems() == []
    c = census({**two, "b": [{"rank": 2, "world_size": 4}]})
    assert not c.complete and c.missing == [3]
    c = census({**two, "c": [{"rank": 1, "world_size": 4}]})
    assert c.twice == {1: ["a", "c"]} and "rank 1 announced 2 times (nodes a, c)" in c.problems()
    c = census({**two, "c": [{"rank": 4, "world_size": 8}]})
    assert not c.complete and c.worlds == {4, 8} and c.missing == [5, 6, 7]
    c = census({"a": [{"rank": 0, "world_size": 1}, {"rank": 3, "world_size": 1}]})
    assert c.outside == [3] and not c.complete
    assert not census({}).complete
