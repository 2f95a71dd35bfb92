"""Re-plans that keep every rank and TP group but give each replica a layer split of its own
(``ranks_fixed``), as Megatron-LM's loop runs them where the layer-wise gradient sync carries the job."""

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner import HardwareModel, Health, plan_adaptation
from resihp_ext.planner.moves import state_moves

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=2, global_batch_size=32)
# TP2 x PP2 x DP2: stage 0 is ranks (0, 1) in replica 0 and (2, 3) in replica 1; stage 1 is (4, 5), (6, 7).
LAYOUT = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=2)
HW = HardwareModel(layer_forward_s=0.01, output_forward_s=0.002, regroup_s=0.5)
REPLICA1_STAGE0_SLOW = Health(speed={2: 0.5})


def _stage_ranks(layout: Layout) -> list[list[tuple[int, ...]]]:
    return [[st.ranks for st in rep.stages] for rep in layout.replicas]


def test_only_the_slowed_replica_moves_layers_and_every_stage_keeps_its_ranks():
    plan = plan_adaptation(LAYOUT, REPLICA1_STAGE0_SLOW, HW, ranks_fixed=True)
    assert plan.action == "adapt", plan.reason
    assert _stage_ranks(plan.layout) == _stage_ranks(LAYOUT)
    assert plan.layout.replicas[0] == LAYOUT.replicas[0]  # the healthy replica keeps its split
    assert plan.layout.replicas[1].layers_per_stage[0] < 4
    assert plan.layout.replicas_line_up() and not plan.layout.replicas_alike()
    assert plan.transfers == state_moves(LAYOUT, plan.layout, frozenset(), HW)
    # A layer goes from replica 1's first stage to its second, nothing else moves.
    assert {(t.src, t.dst) for t in plan.moves} == {(2, 6), (3, 7), (2, 7)}
    assert plan.iteration_s_after < plan.iteration_s_before


def test_a_split_of_its_own_beats_one_split_for_every_replica():
    own = plan_adaptation(LAYOUT, REPLICA1_STAGE0_SLOW, HW, ranks_fixed=True)
    alike = plan_adaptation(LAYOUT, REPLICA1_STAGE0_SLOW, HW, stages_alike=True)
    assert own.iteration_s_after < alike.iteration_s_after


def test_no_tp_group_shrinks_and_no_replica_is_dropped_unless_allowed():
    very_slow = Health(speed={2: 1 / 16})
    plan = plan_adaptation(LAYOUT, very_slow, HW, ranks_fixed=True)
    assert plan.layout is None or len(plan.layout.replicas) == 2
    assert plan.layout is None or _stage_ranks(plan.layout) == _stage_ranks(LAYOUT)
    # Allowed, dropping the replica (its ranks left out) is one more option, priced against the rest.
    may_drop = plan_adaptation(LAYOUT, very_slow, HW, ranks_fixed=True, drop_to={1, 2})
    assert may_drop.iteration_s_after <= plan.iteration_s_after
    dead_slow = plan_adaptation(LAYOUT, Health(speed={2: 1e-3}), HW, ranks_fixed=True, drop_to={1, 2})
    assert dead_slow.action == "adapt" and dead_slow.layout.replicas == LAYOUT.replicas[:1], dead_slow.reason


def test_the_other_restrictions_take_precedence():
    fixed = plan_adaptation(LAYOUT, REPLICA1_STAGE0_SLOW, HW, ranks_fixed=True, stages_fixed=True)
    assert fixed.layout is None or fixed.layout == LAYOUT
    alike = plan_adaptation(LAYOUT, REPLICA1_STAGE0_SLOW, HW, ranks_fixed=True, stages_alike=True)
    assert alike.layout is None or alike.layout.replicas_alike()
