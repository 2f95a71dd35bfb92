"""Layers moved between stages on Megatron-LM's own loop, 8 CPU ranks
TP2 x PP2 x DP2 with the distributed optimizer and sequence parallelism, checkpoints in
``torch_dist``.

Both replicas' first stage slowed 3x is named by the detector, and the re-plan moves a layer off
that stage in every replica (one split for all: Megatron builds every replica from one model
configuration), the distributed optimizer's parts going with the layers; a rank killed later is
survived in place by the replica left whole, with the split it runs. Training stays what stock
Megatron-LM computes: every logged loss, and every tensor of the saved checkpoint (weights, fp32
main parameters, Adam's moments, addressed by their place in the whole model), equal a failure-free
run with no ``--resihp-*`` flag, which saved with its even split.

Under the interleaved schedule a layer crosses the border of two model chunks next to each other in
megatron-core's order, with its optimizer parts; with Megatron's plain optimizer the replicas take
splits of their own there too, their gradients summed layer by layer over every model chunk.

At TP 1, once replicas hold splits of their own, devices that slow as the job re-plans are still
found: each stage group is then judged against what the planner priced it at until its own cost
model is fitted.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from resihp_ext.layout import ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.memory import megatron_state_bytes, stage_memory_bytes
from tests.dist.launch import assert_moved_as_planned, check, decisions, read_events, run_job
from tests.dist.megatron_jobs import (assert_stock_training, checkpoint_tensors, distributed_job_args, job_args,
                                     logged_losses, replaced, resilience_flags, stock_dist_training)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

ITERATIONS = 28


def layer_job_args(tmp, name: str) -> list[str]:
    return replaced(distributed_job_args(tmp, name), {"--train-iters": str(ITERATIONS)})


def slowed_run(args: list[str], events, *faults: str) -> subprocess.CompletedProcess:
    """``args`` with resilience on and each ``faults`` injected, each rank a device of its own
    (``--cpu-device-time-scale 4``: 8 ranks on 2 cores, so that a slowed rank waits instead of
    taking its neighbours' cores) and the trial off (``--resihp-verify-iters 0``: these tests hold the
    moves to Megatron's numbers). The job must finish."""
    injected = [arg for fault in faults for arg in ("--resihp-inject", fault)]
    proc = run_job(8, [*args, *resilience_flags(events), "--resihp-verify-iters", "0", "--cpu-device-time-scale", "4",
                       *injected], timeout_s=600)
    check(proc)
    return proc


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer_moves_failure_free")
    return stock_dist_training(8, tmp, layer_job_args(tmp, "ckpt"))


def test_a_slow_first_stage_gives_a_layer_to_the_next_in_every_replica_in_place_exactly(tmp_path, failure_free):
    # Ranks 0 and 2 are the first TP rank of stage 0 in replicas 0 and 1: both first stages run
    # 3x slow from iteration 5, which moving micro-batches between replicas cannot help. The layer
    # moves by iteration 12 here and pays back within a few iterations in the planner's model; the
    # job runs long enough for a verdict a few iterations later on a slower host.
    events = tmp_path / "events.jsonl"
    proc = slowed_run(layer_job_args(tmp_path, "ckpt"), events, "slow:rank=0,factor=3,at=5", "slow:rank=2,factor=3,at=5",
                      "kill:rank=7,at=20")
    assert "re-plans of the micro-batch split and of the layers per stage" in proc.stdout, proc.stdout[-3000:]
    assert len(read_events(events, "start")) == 8  # one start per process: nothing restarted
    # The first verdict may move micro-batches alone (the other first stage not yet named).
    moved = [a for a in read_events(events, "adapted") if a["world_size"] == 8 and a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved, decisions(events)
    layers = moved[0]["layers_per_replica"]
    assert layers[0] == layers[1] and layers[0][0] < 2 and sum(layers[0]) == 4, decisions(events)
    assert moved[0]["iteration"] < 20, decisions(events)
    assert_moved_as_planned(events)
    # Rank 7 (replica 1's last stage) SIGKILLed after the move: replica 0 goes on alone with the
    # split it runs, rank 7's part of the optimizer state taken from its copy.
    after = read_events(events, "adapted")[-1]
    assert after["iteration"] == 20 and after["world_size"] == 4 and after["layers_per_replica"] == [layers[0]], \
        decisions(events)
    assert_stock_training(proc.stdout, tmp_path, failure_free, ITERATIONS)


@pytest.fixture(scope="module")
def bf16_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer_moves_bf16_failure_free")
    return stock_dist_training(8, tmp, [*layer_job_args(tmp, "ckpt"), "--bf16"])


def test_in_bf16_a_moved_layer_carries_its_fp32_main_parameters_and_moments(tmp_path, bf16_failure_free):
    # As above, in bf16: every layer's fp32 main parameters and Adam's moments go with it in the
    # distributed optimizer's parts. Made again from the bf16 weights, a main parameter would be off
    # by up to half a bf16 step (2**-9 of its value: up to 2.4e-4 for this model's largest weights),
    # and Adam's steps would not take that back. What does differ: after the move Megatron sums the
    # gradient norm over other stages (rounding, as in fp32), and in bf16 such a difference flips the
    # rounding of some weights, which later steps carry on. Measured here (2026-12-03), at the end
    # of 36 iterations (the job now runs 28): losses within 1.1e-5 of stock's (relative), fp32 main parameters within
    # 2.5e-5 (absolute), the QKV bias aside (its key third's gradient is rounding noise, see
    # megatron_jobs.assert_stock_training).
    events = tmp_path / "events.jsonl"
    proc = slowed_run([*layer_job_args(tmp_path, "ckpt"), "--bf16"], events, "slow:rank=0,factor=3,at=5",
                      "slow:rank=2,factor=3,at=5")
    moved = [a for a in read_events(events, "adapted") if a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved and moved[0]["layers_per_replica"][0][0] < 2, decisions(events)
    assert_moved_as_planned(events)
    expected, want = bf16_failure_free
    got = logged_losses(proc.stdout)
    assert sorted(got) == list(range(1, ITERATIONS + 1)), proc.stdout[-3000:]
    assert max(abs(got[i] / expected[i] - 1) for i in got) < 1e-4, (got, expected)
    have = checkpoint_tensors(tmp_path / "ckpt", tmp_path)
    mains = [k for k in want if k.startswith("optimizer.state.param.") and not k.endswith("linear_qkv.bias")]
    assert mains and sorted(have) == sorted(want)
    for name in mains:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-4, msg=name)


def interleaved_job_args(tmp, name: str) -> list[str]:
    """The distributed-optimizer job above under the interleaved schedule: two chunks of one layer on
    each stage (megatron-core puts layers 0 and 2 on stage 0, 1 and 3 on stage 1)."""
    return [*layer_job_args(tmp, name), "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def interleaved_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer_moves_interleaved_failure_free")
    return stock_dist_training(8, tmp, interleaved_job_args(tmp, "ckpt"))


def test_under_the_interleaved_schedule_a_layer_crosses_a_chunk_border_with_its_optimizer_parts_exactly(
        tmp_path, interleaved_failure_free):
    # Both first stages slowed 3x, as above. Under the interleaved schedule stage 0 holds layers 0
    # and 2, one per chunk; the re-plan [2, 2] -> [1, 3] shifts one layer across the border of two
    # chunks next to each other in megatron-core's order (``resihp_ext.interleaved_split``), which
    # leaves one of stage 0's chunks without a transformer layer; the layer's distributed-optimizer
    # parts go with it. Training stays stock Megatron-LM's, checkpoint included.
    events = tmp_path / "events.jsonl"
    proc = slowed_run(interleaved_job_args(tmp_path, "ckpt"), events, "slow:rank=0,factor=3,at=5",
                      "slow:rank=2,factor=3,at=5")
    assert "re-plans of the micro-batch split and of the layers per stage" in proc.stdout, proc.stdout[-3000:]
    moved = [a for a in read_events(events, "adapted") if a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved and moved[0]["layers_per_replica"] == [[1, 3], [1, 3]], decisions(events)
    assert_moved_as_planned(events)
    # Exactly one layer, one megatron-core held on stage 0 (0 or 2), went to stage 1 in each replica.
    sent = {tuple(t["item"]) for e in read_events(events, "moved") for t in e["sent"] if t["src"] != t["dst"]}
    assert len(sent) == 1 and sent <= {("layer", 0), ("layer", 2)}, sent
    assert_stock_training(proc.stdout, tmp_path, interleaved_failure_free, ITERATIONS)


def launch_stage_bytes(layers: int, stage: int) -> float:
    """The planner's estimate of a stage's bytes on a device in ``layer_job_args``' job (fp32, TP 2,
    sequence parallelism, megatron-core's local attention, the distributed optimizer over DP 2)."""
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=1, global_batch_size=8)
    hw = HardwareModel(**megatron_state_bytes(half_precision=False, grads_in_fp32=True, distributed_optimizer=True),
                       activation_bytes_per_value=4.0, sequence_parallel=True)
    return stage_memory_bytes(model, hw, num_layers=layers, tp_degree=2, stage=stage, num_stages=2,
                              num_microbatches=4, dp_degree=2)


def test_a_stage_takes_no_layer_beyond_what_the_device_memory_holds(tmp_path):
    # The slowdowns that move a layer from stage 0 to stage 1 in every replica (the first test), on
    # devices that hold the launch's two layers a stage but not a third on stage 1: the split stays.
    fits = max(launch_stage_bytes(2, 0), launch_stage_bytes(2, 1))
    third = min(launch_stage_bytes(3, 0), launch_stage_bytes(3, 1))
    assert fits < third
    gib = (fits + third) / 2 / 2**30
    events = tmp_path / "events.jsonl"
    proc = slowed_run([*replaced(layer_job_args(tmp_path, "ckpt"), {"--train-iters": "20"}),
                       "--resihp-device-memory-gb", f"{gib:.9f}"],
                      events, "slow:rank=0,factor=3,at=5", "slow:rank=2,factor=3,at=5")
    slow = {r for v in read_events(events, "verdict") if v["kind"] == "compute" for r in v["ranks"]}
    assert slow == {0, 2} and read_events(events, "plan"), decisions(events)
    assert all(a["layers_per_replica"] == [[2, 2], [2, 2]] for a in read_events(events, "adapted")), decisions(events)
    assert len(read_events(events, "start")) == 8, proc.stdout[-3000:]
    assert f"plans sized for {gib:.3g} GiB a device" in proc.stdout, proc.stdout[-3000:]


def test_layers_stay_on_their_stages_when_the_checkpoint_format_numbers_them_per_stage(tmp_path):
    # --ckpt-format torch numbers each stage's layers from 0: a checkpoint saved after a move would
    # not load in a stock run, so the job says at start that re-plans keep the stages.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*replaced(layer_job_args(tmp_path, "ckpt"), {"--ckpt-format": "torch", "--train-iters": "2"}),
                       "--resihp-enable", "--resihp-event-log", str(events)],
                   timeout_s=420)
    check(proc)
    assert "re-plans of the micro-batch split only (layers stay on their stages: --ckpt-format torch" in proc.stdout, \
        proc.stdout[-3000:]


OWN_SPLIT_ITERATIONS = 24


def own_split_job_args(tmp, name: str) -> list[str]:
    """TP2 x PP2 x DP2 with Megatron's plain optimizer, sequence parallelism and overlapped gradient
    reduction, saved in ``torch_dist``: each replica may take a layer split of its own, its gradients
    then summed layer by layer (``layer_sync``; the norms' gradients, split over the TP group by
    sequence parallelism, summed over it too) and DDP's overlapped reduction off while replicas differ."""
    return [*replaced(job_args(tmp, name), {"--train-iters": str(OWN_SPLIT_ITERATIONS), "--ckpt-format": "torch_dist"}),
            "--sequence-parallel", "--overlap-grad-reduce"]


@pytest.fixture(scope="module")
def own_split_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_split_failure_free")
    return stock_dist_training(8, tmp, own_split_job_args(tmp, "ckpt"))


def test_a_slow_first_stage_of_one_replica_gives_a_layer_to_its_next_stage_alone_exactly(tmp_path,
                                                                                          own_split_failure_free):
    # Rank 2 is the first TP rank of replica 1's stage 0, slowed 3x from iteration 5: replica 1
    # moves a layer to its second stage, replica 0 keeps the launch's split, and the replicas'
    # gradients are then summed layer by layer, not by megatron-core's DDP over equal buffers.
    # Rank 7 (replica 1's last stage) SIGKILLed later: replica 0 goes on whole, and replica 1 goes on
    # at TP 1 in its own split, its stage 0 run by rank 3 (rank 2 is known slow and stands by), without
    # sequence parallelism, which needs a TP group of two.
    events = tmp_path / "events.jsonl"
    proc = slowed_run(own_split_job_args(tmp_path, "ckpt"), events, "slow:rank=2,factor=3,at=5", "kill:rank=7,at=18")
    assert "of the layers per stage, a split of each replica's own" in proc.stdout, proc.stdout[-3000:]
    moved = [a for a in read_events(events, "adapted") if a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved, decisions(events)
    assert moved[0]["layers_per_replica"][0] == [2, 2], decisions(events)
    assert moved[0]["layers_per_replica"][1][0] < 2 and moved[0]["iteration"] < 18, decisions(events)
    assert_moved_as_planned(events)
    after = read_events(events, "adapted")[-1]
    assert after["iteration"] == 18 and after["world_size"] == 6, decisions(events)
    assert after["layers_per_replica"] == [[2, 2], moved[0]["layers_per_replica"][1]], decisions(events)
    executed = read_events(events, "plan")[-1]["executed"]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[3], [6]]], executed
    assert_stock_training(proc.stdout, tmp_path, own_split_failure_free, OWN_SPLIT_ITERATIONS)


def test_a_rank_killed_while_a_layer_moves_leaves_every_survivor_on_the_split_they_held_exactly(
        tmp_path, own_split_failure_free):
    # Replica 1's first stage (rank 2) slowed 3x from iteration 5, as above; as the re-plan moves a
    # layer from its stage 0 (ranks 2, 3) to its stage 1 (ranks 6, 7), rank 6 is SIGKILLed. The move
    # is abandoned: every survivor goes back to the split all of them still hold whole, and the
    # fail-stop recovery goes on from there without rank 6. Training stays stock Megatron-LM's.
    events = tmp_path / "events.jsonl"
    proc = slowed_run(own_split_job_args(tmp_path, "ckpt"), events, "slow:rank=2,factor=3,at=5",
                      "kill:rank=6,at=5,during=replan")
    killed = [e for e in read_events(events, "inject") if e["fault"].startswith("kill:")]
    assert [e["fault"] for e in killed] == ["kill:rank=6,at=5,during=replan"], decisions(events)
    plans = [p for p in read_events(events, "plan") if p["iteration"] == killed[0]["iteration"]]
    assert plans and "layers [2, 2]->[1, 3]" in plans[0]["reason"], decisions(events)  # it struck a layer move
    assert "back on the old layout" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    adapted = read_events(events, "adapted")
    recovered = [a for a in adapted if a["world_size"] < 8]
    assert recovered and recovered[0]["failed_launch_ranks"] == [6], decisions(events)
    # Nothing adapted to the move the kill broke: until the recovery, every replica ran the launch's split.
    assert all(a["layers_per_replica"] == [[2, 2], [2, 2]] for a in adapted if a["time"] < recovered[0]["time"]), \
        decisions(events)
    assert_stock_training(proc.stdout, tmp_path, own_split_failure_free, OWN_SPLIT_ITERATIONS)


INTERLEAVED_ITERATIONS = 32


def own_split_interleaved_job_args(tmp, name: str) -> list[str]:
    """``own_split_job_args`` under the interleaved schedule (a layer per model chunk), 16 micro-batches
    an iteration. With 8, in groups of two per replica, quotas alone ([6, 2]) and both replicas'
    splits ([4, 4]) came within 5% of each other in the planner's model for the slowdowns below,
    and measured noise picked either. The run is longer than the other own-split jobs because a
    move must pay for itself over the iterations left: where replica 0's verdict came first and its
    layer moved alone, the second move gained 0.08 s an iteration against a 0.5 s re-plan, and
    with 12 iterations left that was within the noise of the measured costs."""
    return [*replaced(own_split_job_args(tmp, name), {"--global-batch-size": "16",
                                                      "--train-iters": str(INTERLEAVED_ITERATIONS)}),
            "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def own_split_interleaved_failure_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_split_interleaved_failure_free")
    return stock_dist_training(8, tmp, own_split_interleaved_job_args(tmp, "ckpt"))


def test_under_the_interleaved_schedule_replicas_move_layers_opposite_ways_and_sum_every_chunks_gradients(
        tmp_path, own_split_interleaved_failure_free):
    # Replica 0's first stage (rank 0) slowed 3x from iteration 5, replica 1's last stage (rank 6)
    # from 9, while rank 0's verdict is being confirmed: once both are known, fewer micro-batches
    # help neither, so each replica moves a layer off its slow stage, the other way from the other's
    # ([1, 3] and [3, 1]), each across a border between two of its chunks. Rank 6 is found after
    # the first re-plan, in a stage whose layer count no other group runs (its cost model never
    # learns from a healthy iteration; its TP sibling shows it). Should both verdicts come before
    # the first re-plan, the split is the same. Their gradients are then summed layer by layer over
    # the replicas' model numbers, in every model chunk of a rank (with the first chunk's alone, the
    # losses left stock's at iteration 14 by 3e-5).
    events = tmp_path / "events.jsonl"
    proc = slowed_run(own_split_interleaved_job_args(tmp_path, "ckpt"), events, "slow:rank=0,factor=3,at=5",
                      "slow:rank=6,factor=3,at=9")
    assert "of the layers per stage, a split of each replica's own" in proc.stdout, proc.stdout[-3000:]
    moved = [a for a in read_events(events, "adapted") if a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved and moved[-1]["layers_per_replica"] == [[1, 3], [3, 1]], decisions(events)
    assert_moved_as_planned(events)
    assert_stock_training(proc.stdout, tmp_path, own_split_interleaved_failure_free, INTERLEAVED_ITERATIONS)



THIRD_DEVICE_ITERATIONS = 28


def tp1_job_args(tmp, name: str) -> list[str]:
    """TP1 x PP2 x DP2 on 4 ranks with Megatron's plain optimizer: each replica may take a split of
    its own, and no stage group has a TP sibling to show a slow rank against."""
    return replaced(job_args(tmp, name), {"--train-iters": str(THIRD_DEVICE_ITERATIONS),
                                          "--tensor-model-parallel-size": "1", "--ckpt-format": "torch_dist",
                                          "--hidden-size": "256"})


def test_devices_slowing_as_the_job_re_plans_are_found_in_old_and_new_stage_shapes(tmp_path):
    # Rank 0 (replica 0's stage 0) slowed 3x from iteration 5: replica 0 moves a layer off it, to
    # [1, 3]. Rank 3 (replica 1's stage 1) slows 3x from 9, as the verdict on rank 0 is confirmed,
    # and rank 2 (replica 0's stage 1, which takes the layer) 3x from the iteration after the
    # re-plan. Every stage group then runs a layer count no other group runs, and no TP sibling
    # shows a slow rank: each model learnt from one group alone, and learnt its slowness as the
    # norm (neither was ever named). Now replica 1's stages keep their shape, and their fits from
    # before the re-plan; replica 0's stage 1 is a new shape, judged against what the planner
    # priced it at until its own model is fitted.
    events = tmp_path / "events.jsonl"
    proc = run_job(4, [*tp1_job_args(tmp_path, "ckpt"), *resilience_flags(events), "--resihp-verify-iters", "0",
                       "--cpu-device-time-scale", "4", "--resihp-inject", "slow:rank=0,factor=3,at=5",
                       "--resihp-inject", "slow:rank=3,factor=3,at=9",
                       "--resihp-inject", "slow:rank=2,factor=3,at=1,during=replan"], timeout_s=600)
    check(proc)
    moved = [a for a in read_events(events, "adapted") if a["layers_per_replica"] != [[2, 2], [2, 2]]]
    assert moved and moved[0]["layers_per_replica"] == [[1, 3], [2, 2]], decisions(events)
    late = [e for e in read_events(events, "inject") if e["fault"].startswith("slow:rank=2")]
    assert late and late[0]["iteration"] == moved[0]["iteration"] + 1, decisions(events)
    for rank, judge in ((3, "its predicted compute time"), (2, "the compute time its plan priced")):
        suspected = [s for s in read_events(events, "suspicion") if s["ranks"] == [rank]]
        assert suspected and judge in suspected[0]["reason"], decisions(events)
        named = [v for v in read_events(events, "verdict") if v["kind"] == "compute" and v["ranks"] == [rank]]
        assert named and named[0]["factor"] > 2.0, decisions(events)
    # Neither was probed beside a device known slow, which made it look as fast as its reference.
    assert all(c["ranks"] not in ([2], [3]) for c in read_events(events, "cleared")), decisions(events)
