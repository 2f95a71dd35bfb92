"""With the optimizer state split over data-parallel ranks, a dead rank's part has no copy: no in-place plan."""

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.survivors import SurvivorPlan, plan_survivors

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=1, global_batch_size=8)
LAYOUT = Layout.uniform(MODEL, 2, 2, 2, (2, 2))  # ranks 0-3 stage 0, 4-7 stage 1; TP pairs, replicas by DP


def test_a_replicated_optimizer_goes_on_in_place_and_a_sharded_one_falls_back_naming_what_was_lost():
    assert plan_survivors(LAYOUT, frozenset({5})).action == "adapt"
    plan = plan_survivors(LAYOUT, frozenset({5}), sharded_optimizer=True)
    assert plan.action == "checkpoint-restart"
    assert plan.missing_shards == ((1, 1),)  # rank 5: stage 1, TP rank 1
    assert plan.spares == (0, 1, 2, 3, 4, 6, 7) and not plan.new_rank
    assert "distributed optimizer" in plan.reason and "[5]" in plan.reason
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan  # it travels through the store unchanged


def test_two_dead_ranks_name_both_positions_once_each():
    plan = plan_survivors(LAYOUT, frozenset({2, 5, 7}), sharded_optimizer=True)
    assert plan.missing_shards == ((0, 0), (1, 1))
