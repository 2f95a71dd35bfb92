"""Plans whose replicas keep TP degrees in descending DP order (``plan_survivors(...,
tp_descending=True)`` and ``plan_readmission(..., tp_descending=True)``, what Megatron-LM's loop
runs a smaller-TP replica under)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.readmission import plan_readmission
from resihp_ext.planner.survivors import continuing_layout, megatron_order, plan_survivors, surviving_layout

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=2, global_batch_size=16)
# Compute dwarfs the gradient sync, as in the tiny CPU jobs: a smaller-TP replica is worth adding.
HW = HardwareModel(layer_forward_s=0.01, output_forward_s=0.005, tp_efficiency=1.0)


def _degrees(layout: Layout) -> list[int]:
    return [r.stages[0].tp_degree for r in layout.replicas]


def _replica(*stage_ranks: tuple[int, ...]) -> ReplicaSpec:
    per = MODEL.num_layers // len(stage_ranks)
    return ReplicaSpec(tuple(StageSpec(i * per, per, ranks) for i, ranks in enumerate(stage_ranks)))


def test_a_uniform_job_shrinks_a_broken_replica_after_the_whole_one():
    # Kill 5 of TP2 x PP2 x DP2: replica 1 goes on whole and ranks 0 and 4 of replica 0 run it at TP 1,
    # after it in DP order; rank 1 is a spare.
    layout = Layout.uniform(MODEL, 2, 2, 2)
    plan = plan_survivors(layout, frozenset({5}), hw=HW, tp_descending=True)
    assert plan.kept_replicas == (1,)
    assert [[s.ranks for s in r.stages] for r in plan.rebuilt_replicas] == [[(0,), (4,)]]
    assert plan.spares == (1,)
    assert _degrees(continuing_layout(layout, plan)) == [2, 1]
    assert plan == plan_survivors(layout, frozenset({5}), hw=HW)  # already in order: the same plan


def test_replicas_cut_to_the_counts_the_loop_runs_split_the_whole_batch_between_them():
    # Kill 0 of TP4 x DP2: ranks 1-3 could run replica 0 at TP 2 and TP 1, but the loop runs at most
    # 2 replicas; the quotas are those of the 2 that go on, the whole batch between them.
    layout = Layout.uniform(MODEL, 4, 1, 2)
    plan = plan_survivors(layout, frozenset({0}), hw=HW, tp_descending=True, replica_counts=frozenset({1, 2}))
    continuing = continuing_layout(layout, plan)
    assert _degrees(continuing) == [4, 2]
    assert len(plan.quotas) in (0, 2) and sum(plan.quotas or (4, 4)) == MODEL.num_microbatches, plan.quotas
    assert plan.spares == (3,)


def test_a_known_slow_rank_is_the_last_of_its_group_to_run_a_smaller_replica():
    # Rank 2 (replica 1, stage 0) is known 3x slow when rank 7 dies: of its group, healthy rank 3
    # runs stage 0 of the TP-1 replica, and the batch splits by speed.
    layout = Layout.uniform(MODEL, 2, 2, 2)
    plan = plan_survivors(layout, frozenset({7}), hw=HW, health=Health(speed={2: 1 / 3}), tp_descending=True)
    assert [[s.ranks for s in r.stages] for r in plan.rebuilt_replicas] == [[(3,), (6,)]]
    assert plan.spares == (2,)


def test_a_job_already_mixing_degrees_shrinks_no_further():
    # Replica 0 at TP 2, replica 1 at TP 1 (an earlier shrink). Rank 1 of replica 0 dies: its live rank 0
    # could run stage 0 at TP 1 with rank 2 beside it, but a third degree order is not kept, so only
    # replica 1 goes on.
    layout = Layout((_replica((0, 1), (2, 3)), _replica((4,), (5,))), MODEL)
    free = plan_survivors(layout, frozenset({1}), hw=HW)
    assert free.rebuilt_replicas  # without the rule, a TP-1 replica from ranks 0 and 2
    plan = plan_survivors(layout, frozenset({1}), hw=HW, tp_descending=True)
    assert plan.kept_replicas == (1,) and plan.rebuilt_replicas == ()
    assert set(plan.spares) == {0, 2, 3}


def test_a_larger_replica_rebuilt_behind_a_smaller_kept_one_stays_out():
    # Replicas at TP 2, 1 and 2. Ranks 3 and 10 die: replicas 0 and 2 break, and their intact stage-0
    # groups (0, 1) and (8, 9) could make a TP-2 replica, one taking stage 1. It would follow the kept
    # TP-1 replica, so it stays out; the kept one goes on alone.
    layout = Layout((_replica((0, 1), (2, 3)), _replica((4,), (5,)), _replica((8, 9), (10, 11))), MODEL)
    free = plan_survivors(layout, frozenset({3, 10}), hw=HW)
    assert [r.stages[0].tp_degree for r in free.rebuilt_replicas][:1] == [2]
    plan = plan_survivors(layout, frozenset({3, 10}), hw=HW, tp_descending=True)
    assert plan.action == "adapt" and plan.kept_replicas == (1,) and plan.rebuilt_replicas == ()


def test_kept_replicas_lead_by_degree():
    # Replicas at TP 1 and 2 (in that order), and a third at TP 2 that dies whole: the TP-2 one leads.
    layout = Layout((_replica((0,), (1,)), _replica((2, 3), (4, 5)), _replica((6, 7), (8, 9))), MODEL)
    plan = plan_survivors(layout, frozenset({6, 7, 8, 9}), hw=HW, tp_descending=True)
    assert plan.kept_replicas == (1, 0)
    assert _degrees(continuing_layout(layout, plan)) == [2, 1]


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([2, 4]), pp=st.sampled_from([1, 2]), dp=st.integers(1, 3), data=st.data())
def test_every_plan_keeps_degrees_descending_through_kills(tp, pp, dp, data):
    layout = Layout.uniform(MODEL, tp, pp, dp)
    for _ in range(3):
        dead = frozenset(data.draw(st.sets(st.sampled_from(layout.world_ranks), min_size=1, max_size=2)))
        plan = plan_survivors(layout, dead, hw=HW, tp_descending=True)
        if plan.action != "adapt":
            return
        layout = surviving_layout(layout, plan)
        degrees = _degrees(layout)
        assert degrees == sorted(degrees, reverse=True), degrees
        assert len(plan.quotas) in (0, len(layout.replicas))


def test_standbys_restore_no_replica_at_a_larger_degree_behind_a_smaller_one():
    # Launched TP2 x PP2 x DP3; replica 2 was dropped (its ranks 4, 5, 10, 11 stand by) and replica 1
    # runs at TP 1 on launch ranks 2 and 8. Restoring replica 2 at TP 2 would put it behind the TP-1
    # replica in rank order: with the rule the standbys stay out, saying why.
    launch = Layout.uniform(MODEL, 2, 2, 3)
    layout = Layout((_replica((0, 1), (3, 4)), _replica((2,), (5,))), MODEL)
    identity = (0, 1, 2, 6, 7, 8)
    ready = {4: 1.0, 5: 1.0, 10: 1.0, 11: 1.0}
    free = plan_readmission(layout, identity, launch, ready, Health(), HW, (5, 3), 100)
    assert free.plan.action == "adapt"
    kept = plan_readmission(layout, identity, launch, ready, Health(), HW, (5, 3), 100, tp_descending=True)
    assert kept.plan.action == "keep" and "smaller TP degree" in kept.plan.reason, kept.plan.reason


def test_a_replica_restored_in_place_of_its_smaller_self_keeps_the_order():
    # Launched TP2 x DP2 (PP 1); replica 0 ran at TP 1 on launch rank 0 after rank 1 was left out, and
    # was put after replica 1. Rank 1 back restores replica 0 where its TP-1 self ran: one degree again.
    launch = Layout.uniform(MODEL, 2, 1, 2)
    layout = Layout((_replica((0, 1)), _replica((2,))), MODEL)
    plan = plan_readmission(layout, (2, 3, 0), launch, {1: 1.0}, Health(), HW, (5, 3), 100, tp_descending=True)
    assert plan.plan.action == "adapt", plan.plan.reason
    assert [r.stages[0].tp_degree for r in plan.plan.layout.replicas] == [2, 2]


def test_degrees_descend_in_rank_order_at_every_stage_and_the_last_rank_runs_the_smallest():
    assert Layout((_replica((0, 1), (3, 4)), _replica((2,), (5,))), MODEL).tp_degrees_descend()
    assert not Layout((_replica((0,), (3,)), _replica((1, 2), (4, 5))), MODEL).tp_degrees_descend()
    assert not Layout((_replica((0, 1), (4, 5)), _replica((2,), (3,))), MODEL).tp_degrees_descend()
    assert Layout.uniform(MODEL, 2, 2, 2).tp_degrees_descend()


def test_a_very_slow_rank_leaves_its_tp_group_and_its_replica_goes_last():
    # TP2 x DP2 (PP 1), rank 1 of replica 0 8x slow: with tp_exclusion rank 0 runs replica 0 at TP 1,
    # listed after replica 1 with its quota; numbered in that order, the degrees descend.
    layout = Layout.uniform(MODEL, 2, 1, 2)
    health = Health(speed={1: 1 / 8})
    kept = plan_adaptation(layout, health, HW, ranks_fixed=True, drop_to=(1, 2))
    assert all(r.stages[0].tp_degree == 2 for r in (kept.layout or layout).replicas)
    plan = plan_adaptation(layout, health, HW, ranks_fixed=True, tp_exclusion=True, drop_to=(1, 2))
    assert plan.action == "adapt", plan.reason
    assert [[s.ranks for s in r.stages] for r in plan.layout.replicas] == [[(2, 3)], [(0,)]]
    assert plan.quotas[0] > plan.quotas[1] >= 1 and sum(plan.quotas) == MODEL.num_microbatches
    renumbered = plan.layout.relabel({old: new for new, old in enumerate(megatron_order(plan.layout.replicas))})
    assert renumbered.tp_degrees_descend()
