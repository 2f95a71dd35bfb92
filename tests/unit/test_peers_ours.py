"""Our two policies in the evaluation's shape: the planner's plan and the executor's survivor plan."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.ours import resihp, resihp_in_place
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=12)
LAYOUT = Layout.uniform(MODEL, 1, 1, 4)  # 4 replicas of one GPU, 3 micro-batches each at 3 s


def test_in_place_keeps_the_whole_replicas_after_a_fail_stop():
    plan = resihp_in_place(LAYOUT, Health(dead={2}), HW).first
    # 3 replicas left, 4 micro-batches each: 12 s; one regroup, nothing to move
    assert plan.action == "adapt"
    assert [rep.ranks for rep in plan.layout.replicas] == [(0,), (1,), (3,)]
    assert plan.iteration_s_after == pytest.approx(12.0)
    assert plan.one_time_cost_s == pytest.approx(5.0)


def test_both_answer_a_slowdown_with_the_planner():
    slow = Health(speed={0: 0.5})
    ours, in_place = resihp(LAYOUT, slow, HW), resihp_in_place(LAYOUT, slow, HW)
    assert (ours.first.layout, ours.first.quotas) == (in_place.first.layout, in_place.first.quotas)
    # the slow replica runs 6 s per micro-batch: 2 of them (12 s) and 4 + 3 + 3 on the others
    # (at most 12 s), or 1 (6 s) and 4 + 4 + 3 (12 s): 12 s either way
    assert ours.first.iteration_s_after == pytest.approx(12.0)
