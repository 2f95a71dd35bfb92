"""The planner's compute costs fitted to one measured iteration (resihp_ext.planner.calibration)."""

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.observations import RankObservation
from resihp_ext.planner.calibration import fit_compute_costs

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
