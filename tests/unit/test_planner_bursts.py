"""A plan for a rank slow in bursts is weighed over the bursts and the calm between them
(resihp_ext.planner.bursts)."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner import HardwareModel, Health, plan_adaptation
from resihp_ext.planner.bursts import weigh_bursts
from resihp_ext.planner.cost import iteration_s

MODEL = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                  vocab_size=32768, seq_length=1024, micro_batch_size=1, global_batch_size=64)
LAYOUT = Layout.uniform(MODEL, tp_degree=4, pp_degree=4, dp_degree=2)  # 32 ranks, 2 replicas
EVEN = (32, 32)
HW = HardwareModel()
CALM, BURST = Health(), Health(speed={16: 0.5})  # rank 16: replica 0, stage 2, TP rank 0


def _weighed(share: float, horizon_iters: int = 500):
    plan = plan_adaptation(LAYOUT, BURST, HW, current_quotas=EVEN)
    assert plan.action == "adapt" and plan.layout != LAYOUT  # made for the bursts: layers move off stage 2
    return plan, weigh_bursts(plan, LAYOUT, EVEN, CALM, BURST, share, HW, horizon_iters)


def _expected_s(share, layout, quotas):
    return share * iteration_s(layout, quotas, BURST, HW) + (1 - share) * iteration_s(layout, quotas, CALM, HW)


def test_bursts_half_the_time_keep_the_plan_with_both_phases_weighed():
    plan, weighed = _weighed(0.5)
    assert weighed.action == "adapt" and weighed.quotas == plan.quotas and weighed.layout == plan.layout
    assert weighed.iteration_s_before == pytest.approx(_expected_s(0.5, LAYOUT, EVEN))
    assert weighed.iteration_s_after == pytest.approx(_expected_s(0.5, plan.layout, plan.quotas))
    assert weighed.iteration_s_after < weighed.iteration_s_before
    assert "slow in bursts 50% of the time" in weighed.reason


def test_without_bursts_the_plan_for_them_slows_the_calm_and_is_not_taken():
    plan, weighed = _weighed(0.0, horizon_iters=10**9)  # its one-time cost as good as free
    assert iteration_s(plan.layout, plan.quotas, CALM, HW) > iteration_s(LAYOUT, EVEN, CALM, HW)
    assert weighed.action == "keep" and weighed.quotas == EVEN and weighed.layout == LAYOUT
    assert weighed.iteration_s_before == pytest.approx(iteration_s(LAYOUT, EVEN, CALM, HW))
    assert "does not pay" in weighed.reason


def test_rare_bursts_must_also_pay_back_the_moves():
    plan, _ = _weighed(0.1)
    gain_s = _expected_s(0.1, LAYOUT, EVEN) - _expected_s(0.1, plan.layout, plan.quotas)
    assert 0 < gain_s * 500 < plan.one_time_cost_s  # the premise: faster, but not by enough in 500 iterations
    assert _weighed(0.1, horizon_iters=500)[1].action == "keep"
    assert _weighed(0.1, horizon_iters=10**9)[1].action == "adapt"


def test_a_plan_that_keeps_stays_as_it_is_and_a_share_must_be_a_share():
    keep = plan_adaptation(LAYOUT, CALM, HW, current_quotas=EVEN)
    assert weigh_bursts(keep, LAYOUT, EVEN, CALM, BURST, 0.5, HW, 500) is keep
    with pytest.raises(ValueError, match="share of iterations in bursts"):
        weigh_bursts(keep, LAYOUT, EVEN, CALM, BURST, 1.5, HW, 500)


def test_health_knows_which_slow_ranks_are_slow_in_bursts_through_updates_and_relabels():
    health = Health(speed={3: 0.5, 4: 0.8}, bursts={3})
    assert health.bursts == {3} and health.slow_factors == {3: 2.0, 4: 1.25}
    assert health.updated(Health(speed={4: 0.7}, bursts={4})).bursts == {3, 4}
    assert health.updated(Health(speed={3: 0.4})).bursts == set()  # now slow all the time
    assert health.relabel({3: 1, 4: 2}).bursts == {1} and health.relabel({4: 0}).bursts == set()
    with pytest.raises(ValueError, match="need a speed"):
        Health(speed={4: 0.5}, bursts={3})
