"""Pure geometry of heterogeneous layouts: who holds which TP units, what must move, what survives."""

import pytest

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner.survivors import SurvivorPlan, plan_survivors
from resihp_ext.shard_map import sync_sets, transfers

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=1024,
                  seq_length=64, micro_batch_size=2, global_batch_size=16)
UNIFORM = Layout.uniform(MODEL, 2, 2, 2)  # replica 0: [0,1] [4,5]; replica 1: [2,3] [6,7]


def test_uniform_layout_moves_nothing_and_syncs_like_megatron_dp():
    assert all(t.src == t.dst for t in transfers(UNIFORM, UNIFORM))
    sets = sync_sets(UNIFORM)
    assert sets[(("layer", 0), 0)] == (0, 2) and sets[(("layer", 3), 1)] == (5, 7)
    assert sets[(("first",), 1)] == (1, 3) and sets[(("last",), 0)] == (4, 6)


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


def test_no_whole_replica_names_checkpoint_writers_or_missing_shards():
    saveable = plan_survivors(UNIFORM, frozenset({2, 5}))
    assert saveable.action == "checkpoint-restart" and not saveable.missing_shards
    assert saveable.checkpoint_writers == {(0, 0): 0, (0, 1): 1, (1, 0): 4, (1, 1): 7}
    lost = plan_survivors(UNIFORM, frozenset({5, 7}))
    assert lost.missing_shards == ((1, 1),) and "no survivor holds" in lost.reason

