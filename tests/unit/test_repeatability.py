"""Same-work spread: the floor a micro-batch predictor's MAPE is read against."""

import pytest

from resihp_ext.detection.observations import RankObservation
from resihp_ext.detection.repeatability import same_work_spread


def _obs(rank, stage, features, busy):
    ops = tuple((kind, mb, 0.0, 1.0) for mb in range(len(features)) for kind in ("F", "B"))
    return RankObservation(rank=rank, replica=0, stage=stage, tp_rank=0, ops=ops,
                           features=tuple(features), iteration_s=1.0, busy=tuple(busy))


def test_spread_is_the_mean_deviation_from_each_groups_median():
    # Stage 0: the same micro-batch every iteration; F takes 10, 11, 9, 10 ms (median 10: spread 5%),
    # B takes 20 ms every time (spread 0). 8 ops in all, 4 per group.
    its = [(i, [_obs(0, 0, [(64, 1024, 2)], [f, 0.020])]) for i, f in zip(range(2, 6), (0.010, 0.011, 0.009, 0.010))]
    spread = same_work_spread(its, min_repeats=4)
    assert spread.groups == 2 and spread.ops == 8
    assert spread.mape_pct == pytest.approx(100 * (0 + 0.1 + 0.1 + 0) / 8)


def test_work_differs_by_stage_kind_and_features():
    # Same times, but every op is alone in its group: no group reaches min_repeats.
    its = [(i, [_obs(0, i % 2, [(64, 1024 + i, 2)], [0.01, 0.02])]) for i in range(2, 20)]
    assert same_work_spread(its, min_repeats=2) is None


def test_only_the_window_is_read():
    same = [(64, 1024, 2)]
    its = [(1, [_obs(0, 0, same, [0.5, 0.5])])]  # warm-up: left out by default
    its += [(i, [_obs(0, 0, same, [0.01, 0.02])]) for i in range(2, 10)]
    its += [(i, [_obs(0, 0, same, [0.03, 0.06])]) for i in range(10, 12)]  # slowed from iteration 10
    assert same_work_spread(its, min_repeats=4, last_iteration=9).mape_pct == 0.0
    assert same_work_spread(its, min_repeats=4).mape_pct > 0.0


def test_wall_durations_stand_in_when_no_busy_times():
    obs = [RankObservation(rank=0, replica=0, stage=0, tp_rank=0, ops=(("F", 0, 0.0, d),),
                           features=((64, 1024, 2),), iteration_s=1.0) for d in (0.01, 0.01, 0.02)]
    spread = same_work_spread([(2 + i, [o]) for i, o in enumerate(obs)], min_repeats=3)
    assert spread.mape_pct == pytest.approx(100 * 1.0 / 3)


def test_min_repeats_below_two_is_refused():
    with pytest.raises(ValueError, match="min_repeats must be >= 2"):
        same_work_spread([], min_repeats=1)
