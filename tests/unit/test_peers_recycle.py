"""ReCycle's model on a pipeline small enough to work out by hand."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.recycle import recycle
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health

# f = 1 s and b = 2 s per layer and micro-batch; transfers and the gradient all-reduce cost ~0
HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=12)
# PP=2, DP=3, TP=1: stage 0 of pipeline d is rank d, stage 1 is rank 3 + d; 4 micro-batches each
LAYOUT = Layout.uniform(MODEL, 1, 2, 3)


def test_healthy_and_fail_slow_are_left_alone():
    # 1F1B, 2 stages of 1 layer, 4 micro-batches: (4 + 2 - 1) * (1 + 2) = 15 s
    answer = recycle(LAYOUT, Health(), HW)
    assert answer.first.action == "keep"
    assert answer.first.iteration_s_after == pytest.approx(15.0)
    slow = recycle(LAYOUT, Health(speed={0: 0.5}), HW)
    assert slow.first.action == "keep" and slow.first.iteration_s_after > 15.0


def test_failed_last_stage_is_rerouted_into_the_peers_bubbles():
    # rank 4 = pipeline 1, stage 1. Its 4 micro-batches go to the 2 peers: ceil(4 / 2) = 2 each.
    # A peer's stage 1 is busy 4 * 3 = 12 s of its 15 s and idle 3 s, of which 1 s (its first
    # forward's wait on stage 0) holds no input; 2 s of bubble take 2 * 3 = 6 s of extra work:
    # 4 s spill over, 15 + 4 = 19 s.
    answer = recycle(LAYOUT, Health(dead={4}), HW)
    assert answer.first.action == "adapt"
    assert answer.first.iteration_s_after == pytest.approx(19.0)
    assert answer.first.one_time_cost_s == 5.0  # one regroup, no state moves


def test_failed_first_stage_has_all_its_bubble():
    # rank 1 = pipeline 1, stage 0: no idle before its first forward, so 3 s of bubble: 15 + 6 - 3 = 18 s
    assert recycle(LAYOUT, Health(dead={1}), HW).first.iteration_s_after == pytest.approx(18.0)


def test_a_stage_lost_in_every_pipeline_restarts():
    answer = recycle(LAYOUT, Health(dead={3, 4, 5}), HW)
    assert answer.first.action == "checkpoint-restart"
