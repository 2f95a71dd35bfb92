"""Pure geometry of heterogeneous layouts: who holds which TP units, what must move, what survives."""

import pytest
from hypothesis import given, settings, strategies as st

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import stage_memory_bytes
from resihp_ext.planner.survivors import SurvivorPlan, continuing_layout, moved_groups, plan_survivors, surviving_layout
from resihp_ext.shard_map import Transfer, sync_rank_sets, sync_sets, transfers

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=1024,
                  seq_length=64, micro_batch_size=2, global_batch_size=16)
UNIFORM = Layout.uniform(MODEL, 2, 2, 2)  # replica 0: [0,1] [4,5]; replica 1: [2,3] [6,7]
# A 1.3B-parameter GPT: big enough that compute, not the gradient all-reduce, sets the iteration.
GPT_1B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=51200,
                   seq_length=2048, micro_batch_size=1, global_batch_size=64)


def _memory_for_tp(model: ModelSpec, tp_degree: int, num_stages: int = 2) -> HardwareModel:
    """Devices exactly as large as the biggest stage of a ``num_stages`` split at ``tp_degree``."""
    layers = model.num_layers // num_stages
    peak = max(stage_memory_bytes(model, HardwareModel(), num_layers=layers, tp_degree=tp_degree, stage=p,
                                  num_stages=num_stages, num_microbatches=model.num_microbatches)
               for p in range(num_stages))
    return HardwareModel(device_memory_bytes=peak)


def test_uniform_layout_moves_nothing_and_syncs_like_megatron_dp():
    assert all(t.src == t.dst for t in transfers(UNIFORM, UNIFORM))
    sets = sync_sets(UNIFORM)
    assert sets[(("layer", 0), 0)] == (0, 2) and sets[(("layer", 3), 1)] == (5, 7)
    assert sets[(("first",), 1)] == (1, 3) and sets[(("last",), 0)] == (4, 6)


def test_replicas_at_different_tp_sync_each_finest_unit_and_their_replicated_tensors():
    # replica 0 runs layers at TP=2, replica 1 at TP=4: a TP=2 shard joins two TP=4 shards' sets
    model = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=1024,
                      seq_length=64, micro_batch_size=2, global_batch_size=16)
    layout = Layout((ReplicaSpec((StageSpec(0, 8, (0, 1)),)), ReplicaSpec((StageSpec(0, 8, (2, 3, 4, 5)),))), model)
    sets = sync_sets(layout)
    assert sets[(("layer", 0), 0)] == (0, 2) and sets[(("layer", 0), 1)] == (0, 3)
    assert sets[(("layer", 3), 2)] == (1, 4) and sets[(("layer", 3), 3)] == (1, 5)
    assert set(sync_rank_sets(layout)) == {(0, 2), (0, 3), (1, 4), (1, 5), (0, 1, 2, 3, 4, 5)}


def test_uniform_sync_rank_sets_are_the_dp_groups_and_each_stage_for_its_replicated_tensors():
    assert set(sync_rank_sets(UNIFORM)) == {(0, 2), (1, 3), (4, 6), (5, 7), (0, 1, 2, 3), (4, 5, 6, 7)}


def test_a_transfer_round_trips_through_json_and_says_whether_it_crosses():
    import json

    t = Transfer(("layer", 3), 1, 4, 2, 6, num_bytes=128)
    assert Transfer.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert t.crosses and not Transfer(("first",), 0, 1, 5, 5, replicated=True).crosses
    assert t.what == (("layer", 3), 1, 4, 2, 6, False)


def test_repartition_moves_exactly_the_layer_that_changes_stage():
    new = Layout((UNIFORM.replicas[0], ReplicaSpec((StageSpec(0, 1, (2, 3)), StageSpec(1, 3, (6, 7))))), MODEL)
    moved = {(t.item, t.unit, t.grid, t.src, t.dst, t.replicated) for t in transfers(UNIFORM, new) if t.src != t.dst}
    assert {(m[0], m[3], m[4]) for m in moved} == {(("layer", 1), 2, 6), (("layer", 1), 3, 7), (("layer", 1), 2, 7)}
    assert (("layer", 1), 0, 2, 2, 6, False) in moved and (("layer", 1), 1, 2, 3, 7, False) in moved
    # layer 1 is now synchronised between replica 0's stage 0 and replica 1's stage 1
    assert sync_sets(new)[(("layer", 1), 0)] == (0, 6)


def test_smaller_tp_gathers_both_units_and_joins_both_sync_sets():
    tp1 = ReplicaSpec((StageSpec(0, 2, (2,)), StageSpec(2, 2, (6,))))
    new = Layout((UNIFORM.replicas[0], tp1), MODEL)
    into_2 = {(t.unit, t.src) for t in transfers(UNIFORM, new) if t.dst == 2 and t.item == ("layer", 0) and not t.replicated}
    assert into_2 == {(0, 2), (1, 3)}  # keeps its own half, receives the other from its old TP peer
    sets = sync_sets(new)
    assert sets[(("layer", 0), 0)] == (0, 2) and sets[(("layer", 0), 1)] == (1, 2)


def test_dead_holder_is_replaced_by_another_replica_or_refused():
    tp1 = ReplicaSpec((StageSpec(0, 2, (0,)), StageSpec(2, 2, (4,))))
    new = Layout((tp1, UNIFORM.replicas[1]), MODEL)
    into_4 = {(t.unit, t.src) for t in transfers(UNIFORM, new, dead=frozenset({5}))
              if t.dst == 4 and t.item == ("layer", 3) and not t.replicated}
    assert into_4 == {(0, 4), (1, 7)}  # rank 5's half comes from replica 1's rank 7
    with pytest.raises(ValueError, match="no live rank"):
        transfers(UNIFORM, new, dead=frozenset({5, 7}))


def test_survivors_keep_whole_replicas_in_megatron_rank_order():
    plan = plan_survivors(UNIFORM, frozenset({5}))
    assert plan.action == "adapt" and plan.kept_replicas == (1,)
    assert plan.new_rank == {2: 0, 3: 1, 6: 2, 7: 3} and plan.spares == (0, 1, 4)
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan


def test_with_no_rank_of_the_layout_dead_every_replica_continues_as_it_was():
    # What the recovery plans when only ranks outside the layout left (a readmission that did not hold).
    plan = plan_survivors(UNIFORM, frozenset())
    assert plan.action == "adapt" and plan.kept_replicas == (0, 1) and plan.spares == ()
    assert plan.new_rank == {r: r for r in UNIFORM.world_ranks}
    assert plan.reason.startswith("no rank of the layout failed") and surviving_layout(UNIFORM, plan) == UNIFORM


def test_broken_replicas_are_rebuilt_from_their_intact_stage_groups():
    # Rank 2 (replica 1, stage 0) and rank 5 (replica 0, stage 1) die: replica 0's stage 0 and
    # replica 1's stage 1 are still whole, and together hold every layer.
    plan = plan_survivors(UNIFORM, frozenset({2, 5}))
    assert plan.action == "adapt" and plan.kept_replicas == ()
    assert plan.rebuilt_replicas == (ReplicaSpec((StageSpec(0, 2, (0, 1)), StageSpec(2, 2, (6, 7)))),)
    assert plan.new_rank == {0: 0, 1: 1, 6: 2, 7: 3} and plan.spares == (3, 4)
    assert "rebuilt from stage groups" in plan.reason and "DP 2 -> 1" in plan.reason
    # Ranks 3 and 4 could serve a replica at TP 1, but for this small model its gradient sync
    # costs more than its share of the batch saves.
    assert plan.quotas == ()
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan
    new = surviving_layout(UNIFORM, plan)
    assert new == Layout.uniform(MODEL, 2, 2, 1)
    # Each kept rank sits at the stage and TP rank it held: no state has to move.
    old_place = {r: (UNIFORM.stage_of(r)[1], UNIFORM.tp_rank_of(r)) for r in plan.new_rank}
    assert all(old_place[old] == (new.stage_of(n)[1], new.tp_rank_of(n)) for old, n in plan.new_rank.items())


def test_rebuilt_replicas_join_whole_ones_in_megatron_rank_order():
    layout = Layout.uniform(MODEL, 1, 2, 4)  # rank = replica + 4 * stage
    plan = plan_survivors(layout, frozenset({1, 6}))  # replica 1 loses stage 0, replica 2 stage 1
    assert plan.kept_replicas == (0, 3)
    assert [r.ranks for r in plan.rebuilt_replicas] == [(2, 5)]  # replica 2's stage 0 + replica 1's stage 1
    new = surviving_layout(layout, plan)
    assert new.num_replicas == 3 and new == Layout.uniform(MODEL, 1, 2, 3)
    assert plan.new_rank == {0: 0, 3: 1, 2: 2, 4: 3, 7: 4, 5: 5} and plan.spares == ()


def test_without_state_moves_rebuild_takes_only_groups_that_hold_the_same_layers():
    # Replica 1 was repartitioned to [1, 3]: its stage groups do not fit replica 0's [2, 2] stages.
    hetero = Layout((UNIFORM.replicas[0], ReplicaSpec((StageSpec(0, 1, (2, 3)), StageSpec(1, 3, (6, 7))))), MODEL)
    plan = plan_survivors(hetero, frozenset({2, 5}), move_state=False)
    assert plan.action == "checkpoint-restart" and plan.rebuilt_replicas == ()
    assert "no replica can be rebuilt" in plan.reason
    # With state moves, ranks 6, 7 take layers 2-3 of a [2, 2] replica; they already hold them.
    moved = plan_survivors(hetero, frozenset({2, 5}))
    assert [r.layers_per_stage for r in moved.rebuilt_replicas] == [(2, 2)]
    assert [s.ranks for s in moved.rebuilt_replicas[0].stages] == [(0, 1), (6, 7)]
    assert all(t.src == t.dst for t in transfers(hetero, continuing_layout(hetero, moved), frozenset({2, 5})))


def test_intact_groups_take_a_stage_that_is_short_and_receive_its_state():
    layout = Layout.uniform(MODEL, 1, 2, 3)  # rank = replica + 3 * stage
    # Ranks 1 and 2 are both broken replicas' stage 0: their stage-1 groups (ranks 4, 5) are left.
    plan = plan_survivors(layout, frozenset({1, 2}))
    assert plan.kept_replicas == (0,) and [r.ranks for r in plan.rebuilt_replicas] == [(4, 5)]
    assert moved_groups(layout, plan) == (StageSpec(0, 2, (4,)),)
    moves = {(t.item, t.src) for t in transfers(layout, continuing_layout(layout, plan), frozenset({1, 2}))
             if t.dst == 4 and t.src != 4}
    assert moves == {(("first",), 0), (("layer", 0), 0), (("layer", 1), 0)}  # from replica 0's stage 0
    assert surviving_layout(layout, plan) == Layout.uniform(MODEL, 1, 2, 2)
    assert plan.spares == () and "DP 3 -> 2" in plan.reason
    # Without state moves, only replica 0 goes on.
    assert plan_survivors(layout, frozenset({1, 2}), move_state=False).rebuilt_replicas == ()


def test_no_replica_left_names_checkpoint_writers_or_missing_shards():
    # Ranks 1, 2 and 6 leave one stage group whole (4, 5). On devices that hold a stage only at
    # TP 2, that is too few for a replica, yet between them the survivors hold every shard.
    saveable = plan_survivors(UNIFORM, frozenset({1, 2, 6}), hw=_memory_for_tp(MODEL, 2))
    assert saveable.action == "checkpoint-restart" and not saveable.missing_shards
    assert saveable.checkpoint_writers == {(0, 0): 0, (0, 1): 3, (1, 0): 4, (1, 1): 5}
    lost = plan_survivors(UNIFORM, frozenset({5, 7}))
    assert lost.missing_shards == ((1, 1),) and "no survivor holds" in lost.reason
    # Both holders of stage 0's shard 1 dead: no group can be given that state.
    assert plan_survivors(UNIFORM, frozenset({1, 3})).action == "checkpoint-restart"


def test_a_group_that_lost_a_rank_runs_its_stage_at_a_smaller_tp_degree():
    # Ranks 1, 2 and 6 dead: what is left of stage 0's group in replica 0 (rank 0) and of stage
    # 1's in replica 1 (rank 7) make a replica at TP 1; each receives the TP half it lacks (rank 0
    # stage 0's half 1 from rank 3). Stages of one pipeline share a TP degree, so the intact group
    # 4, 5 cannot serve at TP 2 beside rank 0; rank 7 leaves fewer ranks idle than it at TP 1.
    plan = plan_survivors(UNIFORM, frozenset({1, 2, 6}))
    assert plan.action == "adapt"
    assert plan.rebuilt_replicas == (ReplicaSpec((StageSpec(0, 2, (0,)), StageSpec(2, 2, (7,)))),)
    assert moved_groups(UNIFORM, plan) == (StageSpec(0, 2, (0,)), StageSpec(2, 2, (7,)))
    into_0 = {(t.item, t.unit, t.src) for t in transfers(UNIFORM, continuing_layout(UNIFORM, plan), frozenset({1, 2, 6}))
              if t.dst == 0 and t.item == ("layer", 1) and not t.replicated}
    assert into_0 == {(("layer", 1), 0, 0), (("layer", 1), 1, 3)}
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan
    # TP 2 -> 1 needs the missing half moved: not under half precision, and not if TP 1 does not fit.
    assert plan_survivors(UNIFORM, frozenset({1, 2, 6}), move_state=False).action == "checkpoint-restart"
    # With every shrunk replica allowed (a large model), no replica mixes TP degrees.
    big = plan_survivors(Layout.uniform(GPT_1B, 2, 2, 2), frozenset({1, 2, 6}))
    assert [[s.ranks for s in r.stages] for r in big.rebuilt_replicas] == [[(0,), (7,)], [(3,), (4,)]]
    # A TP 2 x DP 2 job that loses one rank of each replica goes on at TP 1 instead of stopping.
    flat = Layout.uniform(MODEL, 2, 1, 2)
    assert [r.ranks for r in plan_survivors(flat, frozenset({0, 3})).rebuilt_replicas] == [(1,)]


def test_a_smaller_tp_replica_is_added_only_when_the_cost_model_predicts_a_faster_iteration():
    layout = Layout.uniform(GPT_1B, 2, 2, 2)
    plan = plan_survivors(layout, frozenset({2, 5}))
    tp1 = ReplicaSpec((StageSpec(0, 12, (3,)), StageSpec(12, 12, (4,))))
    assert plan.rebuilt_replicas == (ReplicaSpec((StageSpec(0, 12, (0, 1)), StageSpec(12, 12, (6, 7)))), tp1)
    # The TP 1 replica is about half as fast, so it gets about a third of the batch.
    assert sum(plan.quotas) == GPT_1B.num_microbatches and plan.quotas[0] > 1.5 * plan.quotas[1] > 0
    assert plan.spares == () and f"micro-batches per replica {list(plan.quotas)}" in plan.reason
    assert surviving_layout(layout, plan).num_replicas == 2
    # Devices that fit a stage only at TP 2: ranks 3 and 4 stay spares.
    small = plan_survivors(layout, frozenset({2, 5}), hw=_memory_for_tp(GPT_1B, 2))
    assert len(small.rebuilt_replicas) == 1 and small.quotas == () and small.spares == (3, 4)




def test_a_group_with_more_live_ranks_than_one_replica_needs_is_split_over_several():
    # TP4 x DP2, rank 0 dead: ranks 1, 2 run a TP-2 replica and rank 3 a TP-1 one, when compute
    # (not the gradient sync) sets the iteration. Each new TP group is part of the old one.
    layout = Layout.uniform(MODEL, 4, 1, 2)
    compute_bound = HardwareModel(layer_forward_s=0.002, output_forward_s=0.001, tp_efficiency=1.0)
    plan = plan_survivors(layout, frozenset({0}), hw=compute_bound)
    assert plan.kept_replicas == (1,) and [r.ranks for r in plan.rebuilt_replicas] == [(1, 2), (3,)]
    assert plan.quotas == (5, 2, 1) and plan.spares == ()
    # Under the default model (A100s, 25 GB/s) neither pays for so small a model: no replica added.
    assert plan_survivors(layout, frozenset({0})).rebuilt_replicas == ()


def test_survivor_quotas_follow_the_slowdowns_known_before_the_failure():
    # TP1 x PP1 x DP3 (rank = replica), global batch of 16 micro-batches. Rank 0 was found 3x slow
    # before rank 2 died: the survivors split the batch by speed, not evenly.
    layout = Layout.uniform(GPT_1B, 1, 1, 3)
    known = Health(speed={0: 1 / 3})
    plan = plan_survivors(layout, frozenset({2}), health=known)
    assert plan.kept_replicas == (0, 1) and sum(plan.quotas) == GPT_1B.num_microbatches
    assert plan.quotas[1] >= 2.5 * plan.quotas[0] >= 2.5
    assert "known slow ranks [0]" in plan.reason
    # Nothing known: Megatron's even split; a slow rank that died is no reason to skew.
    assert plan_survivors(layout, frozenset({2})).quotas == ()
    assert plan_survivors(layout, frozenset({0}), health=known).quotas == ()
    # A replica so slow that speed alone would leave it idle still trains one micro-batch.
    crawling = plan_survivors(layout, frozenset({2}), health=Health(speed={0: 0.01}))
    assert crawling.quotas == (1, GPT_1B.num_microbatches - 1)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]), dp=st.integers(1, 3), big=st.booleans(),
       data=st.data())
def test_every_survivor_plan_is_executable(tp, pp, dp, big, data):
    model = GPT_1B if big else MODEL
    layout = Layout.uniform(model, tp, pp, dp)
    dead = frozenset(data.draw(st.sets(st.sampled_from(layout.world_ranks), min_size=1, max_size=layout.world_size)))
    slow = data.draw(st.dictionaries(st.sampled_from(layout.world_ranks), st.floats(0.05, 1.0), max_size=2))
    plan = plan_survivors(layout, dead, health=Health(speed=slow))
    if plan.action != "adapt":
        return
    new = continuing_layout(layout, plan)  # validates: whole replicas, no rank twice
    assert not set(new.world_ranks) & dead
    assert all(len({s.tp_degree for s in r.stages}) == 1 for r in new.replicas)  # one TP degree per pipeline
    # Every new TP group is (part of) one old TP group: TP traffic keeps the links it had.
    assert all(set(s.ranks) <= set(layout.stage_spec_of(s.ranks[0]).ranks) for r in new.replicas for s in r.stages)
    transfers(layout, new, dead)  # every unit has a live holder
    assert sorted(plan.new_rank.values()) == list(range(new.world_size))
    assert set(plan.spares) == set(layout.world_ranks) - dead - set(new.world_ranks)
    if plan.quotas:
        assert len(plan.quotas) == new.num_replicas and min(plan.quotas) >= 1
        assert sum(plan.quotas) == model.num_microbatches
