"""A slow replica left out and taken back on Megatron-LM's own loop.

PP2 x DP2 on 4 CPU ranks. Rank 3 (replica 1, stage 1) runs 16x slow from iteration 5 to 14: the
detector names it from the timings of Megatron's own schedule, the planner finds that the healthy
replica alone runs the batch sooner than any split between the two, and replica 1 is dropped in
place. Its ranks stand by and probe their devices; once both report healthy, the world grows back
to 4 ranks, the joiners receive their stages' weights and Adam state from the working replica, and
enter Megatron's ``train()`` at the iteration the others run. Every logged loss and the saved
weights equal stock Megatron-LM's failure-free run on 4 ranks, with Megatron's own optimizer, with
its distributed optimizer, and under the interleaved schedule (two model chunks per rank, whose
layers megatron-core places apart: stage 1 holds layers 1 and 3).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scripts.child_env import job_env
from tests.dist.launch import REPO, check, decisions, read_events, run_job, running_quotas
from tests.dist.megatron_jobs import (assert_same_training, job_args, quick_standby_flags, replaced, stock_training,
                                     wait_for)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

ITERATIONS = 32
SLOW = "slow:rank=3,factor=16,at=5,until=14"


def pp2_dp2_args(tmp, name: str) -> list[str]:
    return replaced(job_args(tmp, name), {"--train-iters": str(ITERATIONS), "--tensor-model-parallel-size": "1"})


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    return stock_training(4, pp2_dp2_args(tmp_path_factory.mktemp("standby_failure_free"), "ckpt"))


# What each variant adds to the job's flags.
VARIANTS = {"local": [], "distributed": ["--use-distributed-optimizer"],
            "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"]}


@pytest.fixture(scope="module")
def failure_free_distributed(tmp_path_factory):
    return stock_training(4, [*pp2_dp2_args(tmp_path_factory.mktemp("standby_failure_free_do"), "ckpt"),
                              *VARIANTS["distributed"]])


@pytest.fixture(scope="module")
def failure_free_interleaved(tmp_path_factory):
    return stock_training(4, [*pp2_dp2_args(tmp_path_factory.mktemp("standby_failure_free_vp"), "ckpt"),
                              *VARIANTS["interleaved"]])


def slowed_run(tmp_path, *flags: str):
    """The job with rank 3 16x slow in iterations 5..14 and resilience on, which must finish; the
    trial of a re-plan is off (--resihp-verify-iters 0): one that leaves ranks out is never on trial,
    and these tests hold the whole run to stock Megatron-LM's numbers. Returns the finished process
    and its event log.

    Taking the replica back pays for itself in 9 to 14 of the 18 iterations left after the slowdown
    (0.04 s an iteration gained against a 0.5 s regroup), and exactness holds over 32 iterations,
    not 40 (the key third of a QKV bias drifts with reduction-order noise: ``assert_same_training``).
    So the standbys probe every 0.1 s (at 0.3 s they were ready 2 to 6 iterations after the
    slowdown ended, and once in a suite run too late for the readmission to pay), and are judged
    against a bound that host noise does not reach (``quick_standby_flags``)."""
    events = tmp_path / "events.jsonl"
    proc = run_job(4, [*pp2_dp2_args(tmp_path, "ckpt"), "--resihp-enable",
                       "--resihp-event-log", str(events), "--resihp-verify-iters", "0",
                       *quick_standby_flags(), "--resihp-inject", SLOW, *flags], timeout_s=420)
    check(proc)
    return proc, events


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_very_slow_replica_is_dropped_and_taken_back_once_healthy_exactly(tmp_path, request, variant):
    # Under the distributed optimizer the dropped ranks hand their parts of the optimizer state to
    # replica 0's ranks, and at the readmission every rank receives its position's parts, the joiners
    # their weights with them. Under the interleaved schedule a joiner receives both of its chunks,
    # and the grown world's quotas are whole groups of the pipeline's size.
    failure_free = request.getfixturevalue("failure_free" if variant == "local" else f"failure_free_{variant}")
    proc, events = slowed_run(tmp_path, *VARIANTS[variant])
    assert len(read_events(events, "start")) == 4  # one start per process: nothing restarted
    dropped = [p for p in read_events(events, "plan") if p.get("policy") == "resihp" and p["action"] == "adapt"]
    assert dropped and dropped[0]["quotas"] == [8], decisions(events)
    assert "replica 1: dropped" in dropped[0]["reason"], dropped[0]["reason"]
    standbys = read_events(events, "standby")
    assert sorted(s["launch_rank"] for s in standbys) == [1, 3], decisions(events)
    assert all(s["reference_probe_s"] > 0 for s in standbys), standbys  # they probe their devices
    adapted = read_events(events, "adapted")
    shrunk = [a for a in adapted if a["world_size"] == 2]
    grown = [a for a in adapted if a.get("joined_launch_ranks")]
    assert shrunk and shrunk[0]["quotas"] == [8], decisions(events)
    assert grown and grown[0]["joined_launch_ranks"] == [1, 3] and grown[0]["world_size"] == 4, decisions(events)
    # Taken back only after the slowdown ended, and with training left to gain from it.
    assert 14 <= grown[0]["iteration"] < ITERATIONS, decisions(events)
    assert running_quotas(events) == [4, 4], decisions(events)
    assert "launch rank 3 enters Megatron's loop again at iteration" in proc.stdout
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))


def test_without_standbys_the_dropped_replica_leaves_and_the_job_finishes_exactly(tmp_path, failure_free):
    proc, events = slowed_run(tmp_path, "--resihp-no-standby")
    exits = read_events(events, "exit")
    assert sorted((e["rank"], e["exit_code"]) for e in exits) == [(1, 0), (3, 0)], decisions(events)
    assert not read_events(events, "standby")
    assert running_quotas(events) == [8], decisions(events)
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))


def test_a_joiner_killed_as_the_world_grows_leaves_the_working_replica_going_exactly(tmp_path, failure_free):
    # Launch rank 3 dies inside the grown world, its groups formed, before any state moved: every
    # member goes back to the old layout, the working ranks re-form as they were and run the
    # iteration, launch rank 1 stands by again, and replica 1, short of rank 3, is never restored.
    proc, events = slowed_run(tmp_path, "--resihp-inject", "kill:rank=3,at=1,during=readmission")
    rejoins = [p for p in read_events(events, "plan") if p.get("policy") == "readmission" and p["action"] == "adapt"]
    assert len(rejoins) == 1, decisions(events)
    recovered = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [(a["iteration"], a["world_size"], a["failed_ranks"], a["quotas"]) for a in recovered] == \
        [(rejoins[0]["iteration"], 2, [], [8])], decisions(events)
    assert not [a for a in read_events(events, "adapted") if a.get("joined_launch_ranks")], decisions(events)
    assert "launch rank 1: world 2 failed before every member had its state" in proc.stdout
    assert "the job finished while launch rank 1 stood by" in proc.stdout
    assert running_quotas(events) == [8], decisions(events)
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))


def test_a_joiner_killed_in_the_rendezvous_leaves_the_working_replica_as_it_was(tmp_path, failure_free):
    # Every member has said it is there, so the old world is left and the grown one never forms: the
    # working ranks re-form as they were. The rendezvous gives up at its own bound, not at the
    # collective timeout.
    collective_s = 60
    proc, events = slowed_run(tmp_path, "--resihp-collective-timeout-s", str(collective_s),
                              "--resihp-rendezvous-timeout-s", "2",
                              "--resihp-inject", "kill:rank=3,at=1,during=rendezvous")
    assert "did not form" in proc.stdout + proc.stderr, decisions(events)
    rejoins = [p for p in read_events(events, "plan") if p.get("policy") == "readmission" and p["action"] == "adapt"]
    assert len(rejoins) == 1, decisions(events)
    recovered = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [(a["iteration"], a["world_size"], a["quotas"]) for a in recovered] == \
        [(rejoins[0]["iteration"], 2, [8])], decisions(events)
    assert recovered[0]["time"] - rejoins[0]["time"] < collective_s / 2, (rejoins, recovered)
    assert not [a for a in read_events(events, "adapted") if a.get("joined_launch_ranks")], decisions(events)
    assert running_quotas(events) == [8], decisions(events)
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))


def test_a_standby_stopped_by_a_signal_ends_with_the_job_and_the_launch_exits(tmp_path, failure_free):
    # Launch rank 1 of the dropped replica is SIGSTOPped from outside as it stands by. A stopped
    # process cannot see the job end, and the launch would wait on it forever: the rank that ends the
    # job evicts a standby its beacon marks stopped, and the beacon, a process of its own, SIGKILLs it.
    events, output = tmp_path / "events.jsonl", tmp_path / "output.log"
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--nproc-per-node=4",
           str(REPO / "pretrain_gpt_resilient.py"), *pp2_dp2_args(tmp_path, "ckpt"), "--resihp-enable",
           "--resihp-event-log", str(events), "--resihp-verify-iters", "0", "--resihp-inject", SLOW]
    with open(output, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: [e for e in read_events(events, "standby") if e["launch_rank"] == 1], 300, output)
            standby = next(e for e in read_events(events, "standby") if e["launch_rank"] == 1)
            os.kill(standby["pid"], signal.SIGSTOP)
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail("the launch still waits on the stopped standby:\n" + output.read_text()[-3000:])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = output.read_text()
    assert code == 0, text[-3000:]
    assert f"beacon fences pid {standby['pid']}" in text, text[-3000:]
    assert "launch_local: rank 1 exited with signal SIGKILL" in text, text[-3000:]
    assert not [a for a in read_events(events, "adapted") if a.get("joined_launch_ranks")], decisions(events)
    assert_same_training(text, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))
