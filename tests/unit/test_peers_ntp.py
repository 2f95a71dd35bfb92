"""NTP's model: a TP group that lost a GPU continues at a lower, nonuniform degree."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.ntp import nonuniform_time_factor, ntp
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.tp import group_time_factor

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=10)
# TP=4, PP=1, DP=2: replica 0 is ranks 0-3, replica 1 is ranks 4-7; 10 micro-batches in all
LAYOUT = Layout.uniform(MODEL, 4, 1, 2)


def test_factor_matches_the_planner_when_the_degree_divides_the_heads():
    assert nonuniform_time_factor([0, 1, 2, 3], 8, Health(), HW) == pytest.approx(
        group_time_factor([0, 1, 2, 3], Health(), HW))
    # 3 GPUs for 8 heads: the busiest holds ceil(8 / 3) = 3 heads, 3/8 of the work
    assert nonuniform_time_factor([0, 1, 2], 8, Health(), HW) == pytest.approx(3 / 8)


def test_degraded_replica_runs_at_tp3_and_takes_fewer_micro_batches():
    answer = ntp(LAYOUT, Health(dead={1}), HW)
    plan = answer.first
    # healthy replica: 1/4 * (1 + 2) = 0.75 s per micro-batch; degraded: 3/8 * 3 = 1.125 s.
    # 4 + 6 balances them: 4 * 1.125 = 6 * 0.75 = 4.5 s
    assert plan.action == "adapt"
    assert plan.quotas == (4, 6)
    assert plan.iteration_s_after == pytest.approx(4.5)
    assert plan.one_time_cost_s == pytest.approx(5.0)


def test_a_group_with_no_survivor_drops_its_replica():
    plan = ntp(LAYOUT, Health(dead={0, 1, 2, 3}), HW).first
    # replica 1 alone: 10 * 0.75 = 7.5 s
    assert plan.quotas == (0, 10)
    assert plan.iteration_s_after == pytest.approx(7.5)


def test_fail_slow_is_not_handled():
    assert ntp(LAYOUT, Health(speed={5: 0.5}), HW).first.action == "keep"
