"""Checkpoint-restart: Young/Daly intervals, lost work, restart cost, checkpoint cost."""

import math

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.checkpoint_restart import (
    checkpoint_restart, checkpoint_s, daly_interval_s, expected_lost_s, overhead_fraction, young_interval_s,
)
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=12)
LAYOUT = Layout.uniform(MODEL, 1, 1, 4)  # 4 replicas of one GPU, 3 micro-batches each


def test_young_and_daly():
    assert young_interval_s(10.0, 2000.0) == pytest.approx(200.0)  # sqrt(2 * 10 * 2000)
    # x = 10 / 4000 = 0.0025: 200 * (1 + 0.05 / 3 + 0.0025 / 9) - 10
    assert daly_interval_s(10.0, 2000.0) == pytest.approx(200.0 * (1 + 0.05 / 3 + 0.0025 / 9) - 10.0)
    assert daly_interval_s(50.0, 20.0) == 20.0  # delta >= 2M: checkpoint once per failure
    assert expected_lost_s(200.0, 10.0) == 105.0
    assert overhead_fraction(200.0, 10.0) == pytest.approx(10.0 / 210.0)


def test_checkpoint_cost_is_the_fullest_rank_over_its_bandwidth():
    layer = HW.layer_params(MODEL)
    state = (layer + HW.embedding_params(MODEL) + MODEL.vocab_size * MODEL.hidden_size) * HW.state_bytes_per_param
    assert checkpoint_s(LAYOUT, HW, storage_Bps_per_rank=1e6) == pytest.approx(state / 1e6)


def test_fail_stop_restarts_without_the_node():
    answer = checkpoint_restart(LAYOUT, Health(dead={2}), HW, lost_work_s=50.0, gpus_per_node=1)
    plan = answer.first
    # 3 replicas, 4 micro-batches each at 3 s: 12 s; restart 600 s + 50 s lost
    assert plan.action == "checkpoint-restart"
    assert plan.layout.num_replicas == 3 and 2 not in plan.layout.world_ranks
    assert plan.iteration_s_after == pytest.approx(12.0)
    assert plan.one_time_cost_s == pytest.approx(650.0)


def test_slowdown_restart_only_when_it_pays_over_the_horizon():
    slow = Health(speed={0: 0.5})
    # keep: the slow replica takes 3 micro-batches at 6 s: 18 s/iter. restart: 12 s/iter + 600 s.
    # over 100 iterations 1800 = 1200 + 600 (no gain: keep); over 101, 1818 > 1812 (restart)
    assert checkpoint_restart(LAYOUT, slow, HW, horizon_iters=100, gpus_per_node=1).first.action == "keep"
    assert checkpoint_restart(LAYOUT, slow, HW, horizon_iters=101, gpus_per_node=1).first.action == \
        "checkpoint-restart"
    assert math.isfinite(checkpoint_restart(LAYOUT, slow, HW, gpus_per_node=1).first.iteration_s_after)
