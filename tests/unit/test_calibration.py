"""The planner's compute costs fitted to measured iterations (resihp_ext.planner.calibration)."""

from collections import deque

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.detection.observations import RankObservation
from resihp_ext.detection.op_signals import op_tables
from resihp_ext.planner.calibration import FIT_WINDOW, ComputeCosts, fit_compute_costs, pooled_costs

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256,
                  vocab_size=1024, seq_length=128, micro_batch_size=1, global_batch_size=16)


def _observation(layout, rank, forward_s, backward_s, microbatches=4, noisy=None):
    replica, stage = layout.stage_of(rank)
    ops, busy, t = [], [], 0.0
    for mb in range(microbatches):
        for kind, seconds in (("F", forward_s), ("B", backward_s)):
            seconds = noisy if noisy is not None and (mb, kind) == (0, "F") else seconds
            ops.append((kind, mb, t, t + seconds))
            busy.append(seconds)
            t += seconds
    return RankObservation(rank=rank, replica=replica, stage=stage, tp_rank=layout.tp_rank_of(rank),
                           ops=tuple(ops), features=((128, 16384),) * microbatches, iteration_s=t, busy=tuple(busy))


def test_per_layer_and_output_costs_come_from_the_healthiest_stages_at_tp_1():
    layout = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=2)  # 4 layers per stage
    # Stage 0: 4 layers at TP 2, 0.02 s forward -> 0.01 s per layer at TP 1 on its healthiest rank.
    # Stage 1: 4 layers + output at TP 2, 0.03 s forward -> output = 0.06 - 4 * 0.01 = 0.02 s.
    forward = {0: 0.020, 1: 0.020, 2: 0.026, 3: 0.026, 4: 0.030, 5: 0.030, 6: 0.036, 7: 0.036}
    observations = [_observation(layout, r, forward[r], 2 * forward[r]) for r in range(8)]
    costs = fit_compute_costs(12, observations, layout)
    assert costs.iteration == 12
    assert costs.layer_forward_s == pytest.approx(0.01)
    assert costs.output_forward_s == pytest.approx(0.02)
    assert costs.backward_factor == pytest.approx(2.0)
    hw = costs.hardware(regroup_s=0.5)
    assert hw.layer_forward_s == pytest.approx(0.01) and hw.include_embedding_cost and hw.tp_efficiency == 1.0
    assert hw.regroup_s == 0.5


def test_the_fit_prices_each_group_of_a_layout_as_it_measured_them():
    # The same stages as above: the fit's price of each group is what the group was measured at.
    layout = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=2)
    costs = ComputeCosts(12, layer_forward_s=0.01, output_forward_s=0.02, backward_factor=2.0)
    price = costs.group_microbatch_s(layout)
    assert set(price) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert price[(0, 0)] == pytest.approx(3 * 0.020) and price[(1, 1)] == pytest.approx(3 * 0.030)
    one_stage = ComputeCosts(0, layer_forward_s=0.01, output_forward_s=None, backward_factor=1.5)
    assert one_stage.group_microbatch_s(Layout.uniform(MODEL, 1, 1, 2)) == {(0, 0): pytest.approx(0.2),
                                                                           (1, 0): pytest.approx(0.2)}


def test_known_slowdowns_are_divided_out_so_the_costs_stay_a_healthy_devices():
    # Every stage holding layers alone is slow (rank 0 3x, rank 1 2x: both first stages of TP1 x
    # PP2 x DP2). Told so, the fit is the healthy one; not told, it takes their pace for the layers'.
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=2, dp_degree=2)
    forward = {0: 0.04, 1: 0.04, 2: 0.06, 3: 0.06}  # 4 layers per stage, the output 0.02 s
    healthy = [_observation(layout, r, forward[r], 2 * forward[r]) for r in range(4)]
    slow = {0: 3.0, 1: 2.0}
    slowed = [_observation(layout, r, slow.get(r, 1.0) * forward[r], slow.get(r, 1.0) * 2 * forward[r])
              for r in range(4)]
    assert fit_compute_costs(5, slowed, layout, slow_factors=slow) == fit_compute_costs(5, healthy, layout)
    unaware = fit_compute_costs(5, slowed, layout)
    assert unaware.layer_forward_s == pytest.approx(2 * 0.01)


def test_a_known_slow_groups_sibling_that_does_not_wait_is_not_taken_for_a_fast_device():
    # TP2 x PP2 x DP1, rank 0 known 3x slow; on a CPU its TP sibling, rank 1, does not wait for it
    # and runs at full speed. The group's pace is its slowest rank's, over the factor: rank 1's
    # times over it would have priced the layers 3x too cheap.
    layout = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=1)
    forward = {0: 0.02, 1: 0.02, 2: 0.03, 3: 0.03}
    healthy = [_observation(layout, r, forward[r], 2 * forward[r]) for r in range(4)]
    slowed = [_observation(layout, r, (3.0 if r == 0 else 1.0) * forward[r], (3.0 if r == 0 else 1.0) * 2 * forward[r])
              for r in range(4)]
    assert fit_compute_costs(5, slowed, layout, slow_factors={0: 3.0}) == fit_compute_costs(5, healthy, layout)


def test_one_disturbed_micro_batch_does_not_move_the_fit():
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=2, dp_degree=1)
    calm = [_observation(layout, r, 0.04, 0.08) for r in range(2)]
    disturbed = [_observation(layout, 0, 0.04, 0.08, noisy=0.4), calm[1]]
    assert fit_compute_costs(3, disturbed, layout) == fit_compute_costs(3, calm, layout)


def test_one_stage_cannot_tell_layers_from_the_output():
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=1, dp_degree=2)
    costs = fit_compute_costs(0, [_observation(layout, r, 0.08, 0.2) for r in range(2)], layout)
    assert costs.layer_forward_s == pytest.approx(0.01) and costs.output_forward_s is None
    assert not costs.hardware().include_embedding_cost


def test_nothing_measured_fits_nothing():
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=1, dp_degree=1)
    empty = RankObservation(rank=0, replica=0, stage=0, tp_rank=0, ops=(), features=(), iteration_s=1.0)
    assert fit_compute_costs(0, [empty], layout) is None


def test_one_iteration_that_mismeasured_the_output_layer_does_not_move_the_pooled_costs():
    # Iteration 5's last stage ran long while its layers' stage did not: the output layer's share
    # (a difference of the two) read 2.2x its usual value.
    fits = [ComputeCosts(i, 0.002, 0.0017, 1.0) for i in range(5)] + [ComputeCosts(5, 0.0019, 0.0038, 0.9)]
    pooled = pooled_costs(fits)
    assert (pooled.iteration, pooled.layer_forward_s, pooled.output_forward_s, pooled.backward_factor) == \
        (5, 0.002, 0.0017, 1.0)


def test_a_lasting_change_of_speed_shows_once_it_fills_half_the_window_and_older_fits_drop_out():
    slow_from = FIT_WINDOW // 2 + 1  # the newest fits that outnumber the older ones in the window
    fits = [ComputeCosts(i, 0.001, 0.001, 2.0) for i in range(20)]
    fits += [ComputeCosts(20 + i, 0.003, 0.002, 2.0) for i in range(slow_from)]
    assert pooled_costs(fits[:-1]).layer_forward_s == pytest.approx(0.001)
    assert pooled_costs(fits).layer_forward_s == pytest.approx(0.003)
    assert pooled_costs(fits).output_forward_s == pytest.approx(0.002)
    assert pooled_costs(deque(fits, maxlen=FIT_WINDOW)) == pooled_costs(fits)  # what the decider keeps


def test_fits_from_a_layout_with_another_number_of_stages_are_not_pooled_with_the_newest():
    fits = [ComputeCosts(0, 0.001, 0.004, 2.0), ComputeCosts(1, 0.003, None, 2.0)]
    assert pooled_costs(fits) == ComputeCosts(1, 0.003, None, 2.0)
    with pytest.raises(ValueError, match="at least one fit"):
        pooled_costs([])


def test_each_ranks_op_time_is_the_upper_median_of_its_ops_with_or_without_tables():
    # One rank, one stage of 8 layers: forwards 0.08, 0.16, 0.24, 0.32 s (upper median 0.24 s, so
    # 0.03 s a layer), backwards twice those; and a replica that ran 3 micro-batches.
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=1, dp_degree=2)
    forwards = [0.08, 0.16, 0.24, 0.32]
    ops, busy, t = [], [], 0.0
    for mb, seconds in enumerate(forwards):
        for kind, s in (("F", seconds), ("B", 2 * seconds)):
            ops.append((kind, mb, t, t + s))
            busy.append(s)
            t += s
    four = RankObservation(rank=0, replica=0, stage=0, tp_rank=0, ops=tuple(ops), features=((128, 16384),) * 4,
                           iteration_s=t, busy=tuple(busy))
    three = _observation(layout, 1, 0.4, 0.8, microbatches=3)
    costs = fit_compute_costs(5, [four, three], layout)
    assert costs.layer_forward_s == pytest.approx(0.03) and costs.backward_factor == pytest.approx(2.0)
    assert fit_compute_costs(5, [four, three], layout, op_tables([four, three])) == costs
