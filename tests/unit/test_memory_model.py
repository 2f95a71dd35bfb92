"""The planner's memory model: a Megatron job's state per parameter, the distributed optimizer's share
per data-parallel rank, activations under sequence parallelism, flash attention and recomputation,
and the plans it bounds."""

from __future__ import annotations

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.memory import (activation_bytes_per_layer, largest_stage_bytes, max_layers_on_stage,
                                       megatron_state_bytes, stage_memory_bytes)
from resihp_ext.planner.replica_rebuild import every_replica_at

MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, vocab_size=50304,
                  seq_length=2048, micro_batch_size=1, global_batch_size=64)
STAGE = dict(stage=1, num_stages=4, num_microbatches=64)


@pytest.mark.parametrize("half, grads_in_fp32, sharded, expected", [
    (True, True, False, (18.0, 0.0)),   # bf16 weight, fp32 grad, fp32 master, Adam m and v
    (True, True, True, (6.0, 12.0)),    # the master and moments split over the DP group
    (True, False, True, (4.0, 12.0)),   # gradients accumulated in the weights' precision
    (False, True, False, (16.0, 0.0)),  # fp32: the weights are the master copy
    (False, False, True, (8.0, 8.0)),   # fp32 gradients whatever the flag
])
def test_a_megatron_job_keeps_its_weights_gradients_and_adam_state(half, grads_in_fp32, sharded, expected):
    facts = megatron_state_bytes(half_precision=half, grads_in_fp32=grads_in_fp32, distributed_optimizer=sharded)
    assert (facts["state_bytes_per_param"], facts["sharded_state_bytes_per_param"]) == expected


def test_the_distributed_optimizers_share_shrinks_with_the_data_parallel_degree():
    hw = HardwareModel(**megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=True))
    alone = stage_memory_bytes(MODEL, hw, num_layers=8, tp_degree=2, dp_degree=1, **STAGE)
    of_four = stage_memory_bytes(MODEL, hw, num_layers=8, tp_degree=2, dp_degree=4, **STAGE)
    params = 8 * hw.layer_params(MODEL)
    assert alone - of_four == pytest.approx(params * 12 * (1 - 1 / 4) / 2)
    # One rank alone holds what a job without the distributed optimizer holds.
    plain = HardwareModel(**megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=False))
    assert alone == pytest.approx(stage_memory_bytes(MODEL, plain, num_layers=8, tp_degree=2, **STAGE))
    assert max_layers_on_stage(MODEL, hw, tp_degree=2, dp_degree=4, **STAGE) > \
        max_layers_on_stage(MODEL, hw, tp_degree=2, dp_degree=1, **STAGE)


def test_sequence_parallelism_flash_attention_and_recomputation_keep_fewer_activations():
    s, h = MODEL.seq_length, MODEL.hidden_size
    plain = activation_bytes_per_layer(MODEL, HardwareModel(), 4)
    assert plain == pytest.approx(s * h * (10 + 24 / 4 + 5 * 32 * s / (h * 4)))
    split = activation_bytes_per_layer(MODEL, HardwareModel(sequence_parallel=True), 4)
    assert split == pytest.approx(s * h * (34 / 4 + 5 * 32 * s / (h * 4)))
    flash = activation_bytes_per_layer(MODEL, HardwareModel(sequence_parallel=True, keeps_attention_scores=False), 4)
    assert flash == pytest.approx(s * h * 34 / 4)
    recomputed = activation_bytes_per_layer(MODEL, HardwareModel(recomputes_layers=True), 4)
    assert recomputed == pytest.approx(2 * s * h)
    assert plain > split > flash > recomputed
    # At TP 1 sequence parallelism splits nothing.
    assert activation_bytes_per_layer(MODEL, HardwareModel(sequence_parallel=True), 1) == \
        pytest.approx(activation_bytes_per_layer(MODEL, HardwareModel(), 1))


def test_every_replica_at_a_smaller_degree_fits_with_its_optimizer_state_split_over_the_replicas():
    # TP 2 x PP 2 x DP 4 lost one rank of stage 0 in each of two replicas: six TP-1 replicas (as
    # many as stage 0's six live ranks give), on devices that hold a stage's sixth of the optimizer
    # state at TP 1 but not its half.
    model = ModelSpec(num_layers=8, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, vocab_size=50304,
                      seq_length=2048, micro_batch_size=1, global_batch_size=48)
    layout = Layout.uniform(model, 2, 2, 4)
    dead = frozenset({layout.replicas[0].stages[0].ranks[0], layout.replicas[1].stages[0].ranks[0]})
    facts = megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=True)
    needs = [max(stage_memory_bytes(model, HardwareModel(**facts), num_layers=4, tp_degree=1, stage=p, num_stages=2,
                                    num_microbatches=model.num_microbatches, dp_degree=d) for p in (0, 1))
             for d in (2, 6)]
    hw = HardwareModel(**facts, device_memory_bytes=(needs[0] + needs[1]) / 2)
    replicas = every_replica_at(layout, dead, 1, hw)
    assert len(replicas) == 6 and all(r.stages[0].tp_degree == 1 for r in replicas)
    # Where the executor can run at most two replicas, each rank would hold a half: too much.
    assert every_replica_at(layout, dead, 1, hw, replica_counts=frozenset({1, 2})) == ()
    assert len(every_replica_at(layout, dead, 1, HardwareModel(**facts, device_memory_bytes=needs[0] * 1.01),
                                replica_counts=frozenset({1, 2}))) == 2


def test_the_largest_stage_of_a_layout_counts_the_optimizer_share_of_its_replicas():
    hw = HardwareModel(**megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=True))
    layout = Layout.uniform(MODEL, 2, 4, 2)
    stages = [stage_memory_bytes(MODEL, hw, num_layers=8, tp_degree=2, stage=p, num_stages=4,
                                 num_microbatches=MODEL.num_microbatches, dp_degree=2) for p in range(4)]
    assert largest_stage_bytes(layout, hw) == max(stages)
