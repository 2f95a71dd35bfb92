"""Layout: megatron-core rank order, validation messages, queries, JSON round trip, sync groups."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.shard_map import holders, sync_rank_sets, sync_sets

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256,
                  vocab_size=1024, seq_length=128, micro_batch_size=1, global_batch_size=16)


def test_uniform_uses_tp_dp_pp_rank_order():
    layout = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=3)
    for p in range(2):
        for d in range(3):
            stage = layout.replicas[d].stages[p]
            assert stage.ranks == tuple(t + 2 * (d + 3 * p) for t in range(2))
    assert layout.world_ranks == tuple(range(12))
    assert layout.stage_of(8) == (1, 1) and layout.tp_rank_of(9) == 1 and layout.replica_of(7) == 0
    assert layout.replicas[0].layers_per_stage == (4, 4)


def test_uneven_default_split_and_explicit_split():
    model = ModelSpec(7, 64, 8, 256, 1024, 128, 1)
    assert Layout.uniform(model, 1, 3, 1).replicas[0].layers_per_stage == (3, 2, 2)
    assert Layout.uniform(model, 1, 2, 1, (1, 6)).replicas[0].stages[1].layers == range(1, 7)


@pytest.mark.parametrize("stages, message", [
    ((StageSpec(0, 4, (0,)), StageSpec(5, 3, (1,))), "contiguously"),
    ((StageSpec(0, 4, (0,)), StageSpec(4, 3, (1,))), "covers layers"),
    ((StageSpec(0, 4, (0, 1, 2)), StageSpec(4, 4, (3,))), "power of two"),
    ((StageSpec(0, 4, (0,)), StageSpec(4, 4, (0,))), "more than once"),
])
def test_validate_names_the_problem(stages, message):
    with pytest.raises(ValueError, match=message):
        Layout((ReplicaSpec(stages),), MODEL)


def test_tp_degree_must_divide_heads():
    model = ModelSpec(2, 48, 6, 192, 1024, 16, 1)
    with pytest.raises(ValueError, match="num_attention_heads"):
        Layout.uniform(model, 4, 1, 1)


def test_round_trip_through_json():
    layout = Layout.uniform(MODEL, 2, 2, 2)
    assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_relabel_renames_ranks_and_keeps_places():
    layout = Layout.uniform(MODEL, 2, 2, 2)
    renamed = layout.relabel({r: 10 + 2 * r for r in layout.world_ranks})
    assert renamed.world_ranks == tuple(10 + 2 * r for r in range(8))
    for rank in layout.world_ranks:
        assert renamed.stage_of(10 + 2 * rank) == layout.stage_of(rank)
        assert renamed.tp_rank_of(10 + 2 * rank) == layout.tp_rank_of(rank)
    assert renamed.model == layout.model
    with pytest.raises(KeyError):
        layout.relabel({0: 0})


def test_replica_round_trip_and_a_bad_layout_dict_is_named():
    replica = ReplicaSpec((StageSpec(0, 3, (4, 5)), StageSpec(3, 5, (7,))))
    assert ReplicaSpec.from_dict(json.loads(json.dumps(replica.to_dict()))) == replica
    with pytest.raises(ValueError, match="not a layout dict"):
        Layout.from_dict({"model": MODEL.__dict__, "replicas": [{"stage": []}]})


@st.composite
def layouts(draw):
    num_layers = draw(st.integers(2, 8))
    model = ModelSpec(num_layers, 64, 8, 256, 1024, 128, 1)
    replicas, next_rank = [], 0
    for _ in range(draw(st.integers(1, 3))):
        num_stages = draw(st.integers(1, num_layers))
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=num_stages - 1,
                                   max_size=num_stages - 1))) if num_stages > 1 else []
        bounds = [0, *cuts, num_layers]
        stages = []
        for a, b in zip(bounds, bounds[1:]):
            tp = draw(st.sampled_from([1, 2, 4]))
            stages.append(StageSpec(a, b - a, tuple(range(next_rank, next_rank + tp))))
            next_rank += tp
        replicas.append(ReplicaSpec(tuple(stages)))
    return Layout(tuple(replicas), model)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_random_layouts_round_trip_and_sync_every_shard_once_per_replica(layout):
    assert Layout.from_dict(layout.to_dict()) == layout
    sets = sync_sets(layout)
    for item, hs in holders(layout).items():
        finest = max(h.tp_degree for h in hs)
        assert {unit for (i, unit) in sets if i == item} == set(range(finest))
        for unit in range(finest):
            # one holder per replica in every sync set
            ranks = sets[(item, unit)]
            assert len(ranks) == layout.num_replicas == len({layout.replica_of(r) for r in ranks})
    assert set(sync_rank_sets(layout)) <= set(sets.values()) | {tuple(sorted(h.rank for h in hs))
                                                                 for hs in holders(layout).values()}
