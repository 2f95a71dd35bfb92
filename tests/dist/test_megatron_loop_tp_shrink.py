"""Replicas at a smaller TP degree on Megatron-LM's own loop, with Megatron's plain optimizer and
checkpoints in ``torch_dist``: after a failure, and around a very slow rank.

On 8 CPU ranks, TP2 x PP2 x DP2, rank 5 (replica 0, stage 1, TP rank 1) is SIGKILLed: replica 1 goes on whole, and the live ranks
of replica 0's two stage groups run it at TP 1, each keeping its TP half of every split tensor and
receiving the other half; the replicas' gradients are then summed layer by layer. Training stays
what stock Megatron-LM computes: every logged loss, and every tensor of the checkpoint saved after
the shrink (weights and Adam's moments, whole), equal a failure-free run with no ``--resihp-*``
flag. The same under the interleaved schedule, two model chunks per rank.

Under the distributed optimizer (its gradient buffers pair replica with replica, so replicas stay
alike), ranks 0 and 3 (stage 0 of either replica, each group down to one rank) SIGKILLed at
once: no replica is whole and none can be rebuilt at TP 2, so every replica is re-formed at TP 1
from the live ranks, each stage's optimizer state gathered whole from its parts (the dead ranks'
from their copies) and split anew; training equal to stock Megatron-LM's as above, under either
schedule.

On 4 CPU ranks, TP2 x DP2: a very slow rank leaves its TP group, its replica going on at TP 1 and
after the other in Megatron's rank order, and rejoins once healthy, training equal to stock
Megatron-LM's as above.
"""

from __future__ import annotations

import pytest

from tests.dist.launch import check, decisions, read_events, run_job
from tests.dist.megatron_jobs import (assert_stock_training, distributed_job_args, job_args, quick_standby_flags,
                                     replaced, resilience_flags, stock_dist_training)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

ITERATIONS = 8


def shrink_job_args(tmp, name: str) -> list[str]:
    return replaced(job_args(tmp, name), {"--ckpt-format": "torch_dist"})


# Under the interleaved schedule (two chunks of one layer per stage) the shrunk replica's chunks are
# rebuilt at TP 1 and its stage groups receive the other TP half of both chunks' layers.
SCHEDULES = {"1f1b": [], "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"]}


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def schedule(request):
    return request.param


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory, schedule):
    tmp = tmp_path_factory.mktemp(f"tp_shrink_failure_free_{schedule}")
    return stock_dist_training(8, tmp, [*shrink_job_args(tmp, "ckpt"), *SCHEDULES[schedule]])


def test_a_tp_group_that_lost_a_rank_goes_on_at_tp_1_beside_the_whole_replica_exactly(tmp_path, failure_free, schedule):
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*shrink_job_args(tmp_path, "ckpt"), *SCHEDULES[schedule], *resilience_flags(events),
                       "--resihp-inject", "kill:rank=5,at=4"], timeout_s=420)
    check(proc)
    assert "a stage group that lost ranks going on at a smaller TP degree" in proc.stdout, proc.stdout[-3000:]
    executed = read_events(events, "plan")[-1]["executed"]
    assert executed["kept_replicas"] == [1], decisions(events)
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[0], [4]]], executed
    quotas = executed["quotas"]
    assert sum(quotas) == 8 and quotas[0] > quotas[1] >= 1, quotas  # the TP-1 replica is the slower
    assert "launch rank 1 is a spare" in proc.stdout + proc.stderr
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"]) for a in adapted] == [(4, 6)], adapted
    assert_stock_training(proc.stdout, tmp_path, failure_free, ITERATIONS)


@pytest.fixture(scope="module")
def distributed_failure_free(tmp_path_factory, schedule):
    tmp = tmp_path_factory.mktemp(f"tp_shrink_distributed_failure_free_{schedule}")
    return stock_dist_training(8, tmp, [*distributed_job_args(tmp, "ckpt"), *SCHEDULES[schedule]])


def test_under_the_distributed_optimizer_every_replica_goes_on_at_tp_1_when_no_replica_is_left_whole(
        tmp_path, distributed_failure_free, schedule):
    # Ranks 0 and 3 hold TP halves of stage 0 in replicas 0 and 1: before, no replica could go on and
    # the job stopped at its last checkpoint. Their parts' copies live on ranks 2 and 1. Under the
    # interleaved schedule the TP-1 save holds stage 0's word embedding in a bucket after padding
    # (``reshardable_save_offsets``).
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*distributed_job_args(tmp_path, "ckpt"), *SCHEDULES[schedule], *resilience_flags(events),
                       "--resihp-inject", "kill:rank=0,at=4", "--resihp-inject", "kill:rank=3,at=4"], timeout_s=420)
    check(proc)
    assert "taking every replica to one smaller TP degree" in proc.stdout, proc.stdout[-3000:]
    plan = read_events(events, "plan")[-1]
    assert plan["action"] == "adapt" and "every replica re-formed at TP 1" in plan["reason"], decisions(events)
    executed = plan["executed"]
    assert executed["kept_replicas"] == [] and executed["part_sources"] == {"0": 2, "3": 1}, executed
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[1], [4]], [[2], [5]]], \
        executed
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["data_parallel_size"]) for a in adapted] == [(4, 4, 2)], adapted
    assert_stock_training(proc.stdout, tmp_path, distributed_failure_free, ITERATIONS)


EXCLUSION_ITERATIONS = 28


def exclusion_job_args(tmp, name: str) -> list[str]:
    """TP2 x DP2 (PP 1) on 4 ranks, Megatron's plain optimizer, saved in ``torch_dist``."""
    return replaced(job_args(tmp, name), {"--ckpt-format": "torch_dist", "--pipeline-model-parallel-size": "1",
                                          "--train-iters": str(EXCLUSION_ITERATIONS)})


@pytest.fixture(scope="module")
def exclusion_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_exclusion_failure_free")
    return stock_dist_training(4, tmp, exclusion_job_args(tmp, "ckpt"))


def test_a_very_slow_rank_leaves_its_tp_group_and_rejoins_once_healthy_exactly(tmp_path, exclusion_failure_free):
    # Rank 1 (replica 0, TP rank 1) runs 8x slow from iteration 3 until 14. Replica 0 goes on at TP 1 on
    # rank 0, numbered after replica 1 (the largest degree leads Megatron's data-parallel groups), and
    # rank 1 stands by, probing its device; once healthy it rejoins and replica 0 runs at TP 2 again.
    # Every rank acts as a device of its own (--cpu-device-time-scale 4: 4 ranks on 2 cores). The
    # rejoin pays back only with 6 or more iterations left; it comes at 16 or 17, and once, on a
    # host busy with the whole suite, at 20, with 4 left of 24: the job runs 28, and the standby
    # probes every 0.1 s (``quick_standby_flags``).
    events = tmp_path / "events.jsonl"
    proc = run_job(4, [*exclusion_job_args(tmp_path, "ckpt"), *resilience_flags(events),
                       "--cpu-device-time-scale", "4", *quick_standby_flags(),
                       "--resihp-inject", "slow:rank=1,factor=8,at=3,until=14"], timeout_s=600)
    check(proc)
    assert "and a very slow rank left out of its TP group" in proc.stdout, proc.stdout[-3000:]
    assert "TP 2->1 excluding ranks [1]" in read_events(events, "plan")[0]["reason"], decisions(events)
    adapted = read_events(events, "adapted")
    assert [a["world_size"] for a in adapted] == [3, 4], decisions(events)
    assert adapted[1]["joined_launch_ranks"] == [1] and adapted[1]["quotas"] == [4, 4], decisions(events)
    assert_stock_training(proc.stdout, tmp_path, exclusion_failure_free, EXCLUSION_ITERATIONS)


def split_job_args(tmp, name: str) -> list[str]:
    """TP4 x DP2 (PP 1) on 8 ranks, saved in ``torch_dist``."""
    return replaced(job_args(tmp, name), {"--ckpt-format": "torch_dist", "--pipeline-model-parallel-size": "1",
                                          "--tensor-model-parallel-size": "4"})


@pytest.fixture(scope="module")
def split_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_split_failure_free")
    return stock_dist_training(8, tmp, split_job_args(tmp, "ckpt"))


def test_a_tp4_group_that_lost_a_rank_goes_on_at_tp_2_beside_the_whole_replica_exactly(tmp_path, split_failure_free):
    # TP4 x DP2: replica 0 is ranks 0-3, replica 1 ranks 4-7. Rank 0 dies. Replica 1 goes on whole and
    # leads; ranks 1 and 2 run replica 0 at TP 2, and rank 3 stands by (a third replica at TP 1
    # would leave the batch of 8 micro-batches split over three).
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*split_job_args(tmp_path, "ckpt"), *resilience_flags(events),
                       "--resihp-inject", "kill:rank=0,at=4"], timeout_s=420)
    check(proc)
    assert "launch rank 3 is a spare" in proc.stdout + proc.stderr
    executed = read_events(events, "plan")[-1]["executed"]
    assert executed["kept_replicas"] == [1], decisions(events)
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[1, 2]]], executed
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["data_parallel_size"]) for a in adapted] == [(4, 6, 2)], adapted
    assert_stock_training(proc.stdout, tmp_path, split_failure_free, ITERATIONS)


def test_two_tp_groups_that_each_lost_a_rank_go_on_as_two_tp_1_replicas_exactly(tmp_path, exclusion_failure_free):
    # TP2 x DP2: replica 0 is ranks 0, 1 and replica 1 ranks 2, 3. Ranks 0 and 3 die, so neither TP
    # group is whole. Ranks 1 and 2 each run the whole model at TP 1 (DP 2), each keeping its own
    # half of every TP-split tensor and receiving the other half from the other.
    events = tmp_path / "events.jsonl"
    proc = run_job(4, [*exclusion_job_args(tmp_path, "ckpt"), *resilience_flags(events),
                       *(f"--resihp-inject=kill:rank={r},at=4" for r in (0, 3))], timeout_s=420)
    check(proc)
    assert "is a spare" not in proc.stdout + proc.stderr
    executed = read_events(events, "plan")[-1]["executed"]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[1]], [[2]]], executed
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"]) for a in adapted] == [(4, 2)], adapted
    assert_stock_training(proc.stdout, tmp_path, exclusion_failure_free, EXCLUSION_ITERATIONS)
