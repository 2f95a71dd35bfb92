"""Layout: megatron-core rank order, validation messages, queries, JSON round trip, sync groups."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec

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


def test_sync_groups_of_heterogeneous_replicas():
    # replica 0 runs layers at TP=2, replica 1 at TP=4: a TP=2 shard joins two TP=4 shards' groups
    rep0 = ReplicaSpec((StageSpec(0, 8, (0, 1)),))
    rep1 = ReplicaSpec((StageSpec(0, 8, (2, 3, 4, 5)),))
    layout = Layout((rep0, rep1), MODEL)
    holders = layout.shard_holders()
    assert holders[(0, 0, 4)] == (0, 2) and holders[(0, 1, 4)] == (0, 3)
    assert holders[(3, 2, 4)] == (1, 4) and holders[(3, 3, 4)] == (1, 5)
    groups = layout.sync_groups()
    assert set(groups) == {(0, 2), (0, 3), (1, 4), (1, 5)}
    assert groups[(0, 2)] == tuple((layer, 0, 4) for layer in range(8))


def test_sync_groups_of_uniform_layout_are_dp_groups():
    layout = Layout.uniform(MODEL, 2, 2, 2)
    assert set(layout.sync_groups()) == {(0, 2), (1, 3), (4, 6), (5, 7)}


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
def test_random_layouts_round_trip_and_sync_every_shard(layout):
    assert Layout.from_dict(layout.to_dict()) == layout
    groups = layout.sync_groups()
    keys = [k for ks in groups.values() for k in ks]
    assert len(keys) == len(set(keys))
    for layer in range(layout.model.num_layers):
        finest = layout.finest_tp_degree(layer)
        assert {k[1] for k in keys if k[0] == layer} == set(range(finest))
    for ranks in groups:
        # one holder per replica in every sync group
        assert len(ranks) == layout.num_replicas
        assert len({layout.replica_of(r) for r in ranks}) == layout.num_replicas
