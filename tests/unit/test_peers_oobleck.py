"""Oobleck's model: re-instantiation from templates on a cluster small enough to work out by hand."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.oobleck import oobleck, template
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=12)
# PP=2, DP=3, TP=1 on 3 nodes of 2 GPUs; 2 layers per stage, 4 micro-batches per pipeline
LAYOUT = Layout.uniform(MODEL, 1, 2, 3)


def test_templates_split_layers_over_a_nodes_stages():
    assert template(1, 1, MODEL, HW, 12, 2)[0] == (2, 2)
    assert template(2, 1, MODEL, HW, 12, 2)[0] == (1, 1, 1, 1)
    assert template(3, 1, MODEL, HW, 12, 2) is None  # 6 stages for 4 layers


def test_node_failure_re_instantiates_the_fastest_combination():
    # healthy: per micro-batch 2 layers * 3 s = 6 s per stage; (4 + 1) * 6 = 30 s
    assert oobleck(LAYOUT, Health(), HW, gpus_per_node=2).first.iteration_s_after == pytest.approx(30.0)
    # rank 0 dies: node 0 (ranks 0, 1) leaves, 2 nodes remain. Two 1-node pipelines (2 stages,
    # 6 micro-batches each): (6 + 1) * 6 = 42 s; one 2-node pipeline (4 stages of 3 s, 12
    # micro-batches): (12 + 3) * 3 = 45 s. Oobleck takes the two pipelines.
    answer = oobleck(LAYOUT, Health(dead={0}), HW, gpus_per_node=2)
    plan = answer.first
    assert plan.action == "adapt"
    assert [rep.ranks for rep in plan.layout.replicas] == [(2, 3), (4, 5)]
    assert plan.quotas == (6, 6)
    assert plan.iteration_s_after == pytest.approx(42.0)
    assert plan.one_time_cost_s == pytest.approx(5.0)  # regroup; moved state crosses a ~free link


def test_fail_slow_is_not_handled():
    answer = oobleck(LAYOUT, Health(speed={2: 0.5}), HW, gpus_per_node=2)
    assert answer.first.action == "keep"
    assert answer.first.iteration_s_after == answer.first.iteration_s_before
