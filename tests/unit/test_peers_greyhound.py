"""Greyhound's model: S1 redistribution, S2 gathering of slow GPUs, and the ski-rental switch."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.greyhound import gather_slow, greyhound
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=8)
# TP=2, PP=1, DP=2: replica 0 is ranks (0, 1), replica 1 is ranks (2, 3); 8 micro-batches in all
LAYOUT = Layout.uniform(MODEL, 2, 1, 2)
SLOW = Health(speed={0: 0.5, 2: 0.5})  # one slow GPU in each replica


def test_gathering_puts_both_slow_gpus_in_one_replica():
    new, changed = gather_slow(LAYOUT, SLOW)
    assert [rep.ranks for rep in new.replicas] == [(0, 2), (1, 3)]
    assert changed == (0, 1)


def test_s1_then_s2_by_ski_rental():
    answer = greyhound(LAYOUT, SLOW, HW)
    # S1: both replicas run at half speed, a TP=2 group at 0.5 does 1 / (2 * 0.5) = 1 s per TP=1
    # second: 3 s per micro-batch, 4 each: 12 s
    assert answer.first.iteration_s_after == pytest.approx(12.0)
    # S2: replica (0, 2) at 3 s per micro-batch, replica (1, 3) healthy at 1.5 s; the best split
    # of 8 is 3 + 5 (9 s and 7.5 s): 9 s
    assert answer.then.iteration_s_after == pytest.approx(9.0)
    assert answer.then.one_time_cost_s == pytest.approx(5.0)
    # ski-rental: S1 loses 12 - 9 = 3 s per iteration against S2, whose price is 5 s
    assert answer.switch_after_iters == pytest.approx(5.0 / 3.0)


def test_fail_stop_goes_to_checkpoint_restart():
    answer = greyhound(LAYOUT, Health(dead={1}), HW)
    assert answer.first.action == "checkpoint-restart"
