"""Layer splits under the interleaved schedule: chunk sizes reached by the fewest layer shifts, the
model's layers each stage then holds, and the Layout's items and transfers that name them."""

from __future__ import annotations

import itertools

import pytest

from resihp_ext.interleaved_split import chunk_layers, stage_layers
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.shard_map import holders, transfers


def _moved(before, after) -> int:
    """Layers a change of chunks puts on another stage."""
    return sum(len(set(a) - set(b)) for a, b in zip(stage_layers(after), stage_layers(before)))


def _all_chunks(layers_per_stage, num_chunks):
    """Every way to cut each stage's count into ``num_chunks`` chunks (empty ones too)."""
    per_stage = [[c for c in itertools.product(range(n + 1), repeat=num_chunks) if sum(c) == n] for n in layers_per_stage]
    return [tuple(choice) for choice in itertools.product(*per_stage)]


def test_megatron_core_numbers_layers_chunk_by_chunk_across_the_stages():
    # Two stages of two chunks of two layers: chunk 0 of stage 0 holds 0-1, chunk 0 of stage 1 2-3, ...
    assert stage_layers(((2, 2), (2, 2))) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert stage_layers(((1, 0), (2, 1))) == ((0,), (1, 2, 3))


@pytest.mark.parametrize("launch, split", [
    (((2, 2), (2, 2)), (3, 5)), (((2, 2), (2, 2)), (5, 3)), (((2, 2), (2, 2)), (1, 7)),
    (((1, 1), (1, 1)), (1, 3)), (((1, 1), (1, 1), (1, 1)), (1, 2, 3)), (((2, 2, 2), (2, 2, 2)), (4, 8)),
    (((1, 2), (2, 1), (1, 1)), (3, 3, 2)),
])
def test_a_split_is_reached_by_moving_no_more_layers_between_stages_than_any_other_chunking(launch, split):
    chunks = chunk_layers(launch, split)
    assert tuple(map(sum, chunks)) == split and all(n >= 0 for stage in chunks for n in stage)
    fewest = min(_moved(launch, other) for other in _all_chunks(split, len(launch[0])))
    assert _moved(launch, chunks) == fewest


def test_the_launch_split_keeps_the_launch_chunks_and_ties_go_to_even_chunks():
    assert chunk_layers(((3, 1), (2, 2)), (4, 4)) == ((3, 1), (2, 2))
    # Two layers from stage 0 to stage 1 move either way as two; even chunks are kept where they can be.
    assert chunk_layers(((2, 2), (2, 2)), (2, 6)) == ((1, 1), (3, 3))


def test_a_split_of_another_size_is_refused():
    with pytest.raises(ValueError, match="do not split"):
        chunk_layers(((2, 2), (2, 2)), (4, 5))
    with pytest.raises(ValueError, match="do not split"):
        chunk_layers(((2, 2), (2, 2)), (2, 2, 4))


def _model(launch_chunks) -> ModelSpec:
    return ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                     seq_length=64, micro_batch_size=1, global_batch_size=8, launch_chunks=launch_chunks)


def test_the_layout_names_the_model_layers_a_stage_chunks_hold_and_round_trips_them():
    model = _model(((2, 2), (2, 2)))
    layout = Layout.uniform(model, 1, 2, 2)
    assert layout.held_layers(1) == ((0, 1, 4, 5), (2, 3, 6, 7))
    rank_of_layer = {item[1]: tuple(h.rank for h in hs) for item, hs in holders(layout).items() if item[0] == "layer"}
    assert rank_of_layer[4] == (0, 1) and rank_of_layer[2] == (2, 3)  # stage 0 of each replica holds layer 4
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="launch_chunks"):
        ModelSpec(**{**model.__dict__, "launch_chunks": ((2, 2), (2, 1))})


def test_a_move_sends_only_the_layers_that_change_stage_by_their_model_numbers():
    # [4, 4] -> [3, 5] in both replicas: one layer goes from stage 0 to stage 1; stock numbering
    # would have named layer 3 (stage 0's last in a row), which stage 0 never held.
    model = _model(((2, 2), (2, 2)))
    old, new = Layout.uniform(model, 1, 2, 2), Layout.uniform(model, 1, 2, 2, (3, 5))
    moves = [t for t in transfers(old, new) if t.src != t.dst]
    (layer,) = {t.item for t in moves}
    assert layer[0] == "layer" and layer[1] in stage_layers(((2, 2), (2, 2)))[0]
    assert layer[1] not in new.held_layers(0)[0] and layer[1] in new.held_layers(0)[1]
    assert sorted({(t.src, t.dst) for t in moves}) == [(0, 2), (1, 3)]


def test_without_the_interleaved_schedule_a_stage_holds_its_range():
    layout = Layout.uniform(_model(None), 1, 2, 1, (3, 5))
    assert layout.held_layers(0) == ((0, 1, 2), (3, 4, 5, 6, 7))


def test_the_planner_prices_each_chunk_by_the_layers_it_holds():
    # [4, 4] -> [3, 5] from chunks of two: stage 0 runs chunks of 1 and 2 layers, stage 1 of 3 and
    # 2 (plus the output layer on its last chunk). The price walks the interleaved schedule with
    # each chunk's op at its share of the stage's time, as a hand-made table of op seconds does.
    from resihp_ext.detection.simulator import simulate_iteration
    from resihp_ext.planner.cost import replica_timing
    from resihp_ext.planner.hardware import HardwareModel
    from resihp_ext.planner.health import Health
    from resihp_ext.schedule import Interleaving, OpKind, pipeline_schedule

    hw = HardwareModel(layer_forward_s=0.01, output_forward_s=0.005, interleaving=Interleaving(2), overlap_p2p=True,
                       link_bandwidth_Bps=1e15)
    model = _model(((2, 2), (2, 2)))
    layout = Layout.uniform(model, 1, 2, 1, (3, 5))
    timing = replica_timing(layout.replicas[0], model, hw, Health())
    ops_s = {(0, 0): 0.01, (0, 1): 0.02, (1, 0): 0.03, (1, 1): 0.025}  # one micro-batch's forward per chunk
    assert timing.forward_s == pytest.approx((0.03, 0.055))
    assert [x for row in timing.chunk_shares for x in row] == pytest.approx(
        [ops_s[(s, c)] / timing.forward_s[s] for s in (0, 1) for c in (0, 1)])
    schedule = pipeline_schedule(2, 4, 2, None)
    table_f = [[ops_s[(s, op.chunk)] for op in ops if op.kind is OpKind.FORWARD] for s, ops in enumerate(schedule)]
    table_b = [[2 * ops_s[(s, op.chunk)] for op in ops if op.kind is OpKind.BACKWARD] for s, ops in enumerate(schedule)]
    expected = simulate_iteration(schedule, table_f, table_b, list(timing.p2p_s)).total_s
    assert timing.simulate_s(4) == pytest.approx(expected)
    even = replica_timing(layout.replicas[0], _model(None), hw, Health())
    assert even.chunk_shares is None and even.simulate_s(4) != pytest.approx(expected)
