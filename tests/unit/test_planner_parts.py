"""TP exclusion, PP repartition and DP quotas on hand-checkable cases and against brute force."""

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from resihp_ext.layout import ModelSpec
from resihp_ext.planner.dp import assign_quotas, makespan_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import max_layers_on_stage, stage_memory_bytes
from resihp_ext.planner.pp import partition_layers, stage_times
from resihp_ext.planner.tp import choose_tp, tp_candidates

MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384,
                  vocab_size=50304, seq_length=2048, micro_batch_size=1, global_batch_size=64)
IDEAL = HardwareModel(tp_efficiency=1.0)
STAGE = dict(stage=1, num_stages=4, num_microbatches=16)


# ---------------------------------------------------------------- TP exclusion
def test_tp_keeps_k_times_min_speed_maximiser():
    ranks = tuple(range(8))
    # one device at 0.3x: 8 * 0.3 = 2.4 < 4 * 1.0, so the 4 fastest are kept
    choice = choose_tp(ranks, Health(speed={3: 0.3}), MODEL, IDEAL, **STAGE)
    assert choice.tp_degree == 4 and 3 not in choice.ranks and choice.ranks == (0, 1, 2, 4)
    assert set(choice.spares) == {3, 5, 6, 7}
    # at 0.75x the whole group wins: 8 * 0.75 = 6 > 4
    assert choose_tp(ranks, Health(speed={3: 0.75}), MODEL, IDEAL, **STAGE).tp_degree == 8


def test_tp_excludes_dead_and_stays_power_of_two():
    choice = choose_tp((0, 1, 2, 3), Health(dead=frozenset({2})), MODEL, IDEAL, **STAGE)
    assert choice.ranks == (0, 1) and choice.spares == (3,)


def test_tp_respects_divisibility():
    model = ModelSpec(4, 96, 6, 384, 1026, 64, 1)  # heads 6 and vocab 1026: only TP 1 and 2 divide
    degrees = {c.tp_degree for c in tp_candidates((0, 1, 2, 3), Health(), model, IDEAL, **STAGE)}
    assert degrees == {1, 2}


def test_tp_respects_memory():
    # a device just big enough for the stage's 8 layers at TP=4 but not at TP=2
    need4 = stage_memory_bytes(MODEL, IDEAL, num_layers=8, tp_degree=4, **STAGE)
    hw = HardwareModel(tp_efficiency=1.0, device_memory_bytes=need4 * 1.01)
    choice = choose_tp((0, 1, 2, 3), Health(speed={1: 0.1}), MODEL, hw, min_layers=8, **STAGE)
    assert choice.tp_degree == 4
    assert max_layers_on_stage(MODEL, hw, tp_degree=2, **STAGE) < 8


def test_tp_slow_link_inside_group_drops_one_end():
    hw = HardwareModel(tp_efficiency=0.8)
    choice = choose_tp((0, 1), Health(slow_links={(0, 1): 0.01}), MODEL, hw, **STAGE)
    assert choice.tp_degree == 1


# ---------------------------------------------------------------- PP repartition
def test_pp_hand_check_half_speed_middle_stage():
    part = partition_layers([1.0] * 12, [1.0, 2.0, 1.0])
    assert part.layers_per_stage == (5, 2, 5) and part.bottleneck == 5.0


def test_pp_last_stage_extra_and_caps():
    assert partition_layers([1.0] * 12, [1.0] * 3, last_extra=3.0).layers_per_stage == (5, 5, 2)
    capped = partition_layers([1.0] * 12, [1.0, 2.0, 1.0], max_layers=[4, 12, 12])
    assert capped.layers_per_stage[0] <= 4 and capped.bottleneck == 6.0
    assert partition_layers([1.0] * 4, [1.0] * 2, max_layers=[1, 1]) is None


def test_pp_prefers_current_split_when_equally_good():
    assert partition_layers([1.0] * 6, [1.0, 1.0], prefer=(3, 3)).layers_per_stage == (3, 3)


def _brute_pp(costs, speeds, caps):
    best = math.inf
    n, p = len(costs), len(speeds)
    for cuts in itertools.combinations(range(1, n), p - 1):
        split = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        if all(s <= c for s, c in zip(split, caps)):
            best = min(best, max(stage_times(split, costs, speeds)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 5.0), min_size=2, max_size=9), st.data())
def test_pp_matches_brute_force(costs, data):
    num_stages = data.draw(st.integers(1, min(4, len(costs))))
    speeds = data.draw(st.lists(st.floats(0.2, 3.0), min_size=num_stages, max_size=num_stages))
    caps = data.draw(st.lists(st.integers(1, len(costs)), min_size=num_stages, max_size=num_stages))
    part = partition_layers(costs, speeds, max_layers=caps)
    expected = _brute_pp(costs, speeds, caps)
    if math.isinf(expected):
        assert part is None
    else:
        assert sum(part.layers_per_stage) == len(costs)
        assert all(1 <= n <= c for n, c in zip(part.layers_per_stage, caps))
        assert max(stage_times(part.layers_per_stage, costs, speeds)) == pytest.approx(expected)
        assert part.bottleneck == pytest.approx(expected)


# ---------------------------------------------------------------- DP quotas
def test_dp_hand_check_half_speed_replica():
    # replica 1 is twice as slow per micro-batch: 12 micro-batches split 8 / 4 (both finish at 8)
    assert assign_quotas([0.0, 0.0], [1.0, 2.0], 12) == (8, 4)
    assert assign_quotas([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], 7) == (3, 2, 2)
    assert assign_quotas([0.0, 0.0], [1.0, math.inf], 5) == (5, 0)


def test_dp_fill_cost_counts():
    # a large fill on replica 0 pushes micro-batches to replica 1; it still trains one, since a
    # replica in the job waits on every gradient sync anyway, unless idling is allowed
    assert assign_quotas([10.0, 0.0], [1.0, 1.0], 10) == (1, 9)
    assert assign_quotas([10.0, 0.0], [1.0, 1.0], 10, minimum=0) == (0, 10)
    with pytest.raises(ValueError, match="drop a replica"):
        assign_quotas([0.0, 1.0, 2.0], [1.0, 1.0, 1.0], 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.1, 5.0)), min_size=1, max_size=4),
       st.integers(0, 9), st.sampled_from([0, 1]))
def test_dp_quotas_sum_and_are_optimal(replicas, num_microbatches, minimum):
    fill = [f for f, _ in replicas]
    per = [c for _, c in replicas]
    if minimum * len(replicas) > num_microbatches:
        with pytest.raises(ValueError):
            assign_quotas(fill, per, num_microbatches, minimum)
        return
    quotas = assign_quotas(fill, per, num_microbatches, minimum)
    assert sum(quotas) == num_microbatches and all(q >= minimum for q in quotas)
    best = min(
        makespan_s(fill, per, split)
        for split in itertools.product(range(minimum, num_microbatches + 1), repeat=len(replicas))
        if sum(split) == num_microbatches
    )
    assert makespan_s(fill, per, quotas) == pytest.approx(best)


# ---------------------------------------------------------------- measured output layer
def test_measured_output_layer_cost_replaces_the_flop_estimate():
    derived = HardwareModel(layer_forward_s=0.01)
    assert derived.output_forward_tp1_s(MODEL) == pytest.approx(
        0.01 * MODEL.vocab_size / (4 * MODEL.hidden_size + 2 * MODEL.ffn_hidden_size))
    assert HardwareModel(layer_forward_s=0.01, output_forward_s=0.003).output_forward_tp1_s(MODEL) == 0.003
    assert HardwareModel(output_forward_s=0.003, include_embedding_cost=False).output_forward_tp1_s(MODEL) == 0.0
    with pytest.raises(ValueError, match="output_forward_s"):
        HardwareModel(output_forward_s=-1.0)
