"""Speed levels: follow a device's drift, ignore single outliers, never absorb a fail-slow."""

import dataclasses
import math

import numpy as np
import pytest

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.detector import FailSlowDetector
from resihp_ext.detection.predictor import MicrobatchPredictor
from resihp_ext.detection.speed_level import SpeedLevels
from tests.unit.detector_runs import SPEC, cached_trace, run_detector, stretch_ops


def _feed(levels, group, speed, num_ops=16):
    """One healthy iteration whose ops all ran ``speed`` times the model (model = 1 s per op)."""
    level = levels.level(group)
    return levels.update(group, np.full(num_ops, speed), np.full(num_ops, level))


def test_level_follows_a_drift_within_a_few_iterations():
    levels = SpeedLevels(halflife_iters=2.0, max_drift=0.05)
    for _ in range(8):
        _feed(levels, "g", 1.03)
    assert levels.level("g") == pytest.approx(1.03, abs=0.003)
    for _ in range(8):
        _feed(levels, "g", 0.98)
    assert levels.level("g") == pytest.approx(0.98, abs=0.003)
    assert levels.level("other") == 1.0  # groups are independent


def test_level_is_clamped_so_a_slowdown_cannot_become_the_norm():
    levels = SpeedLevels(halflife_iters=1.0, max_drift=0.05)
    for _ in range(50):
        _feed(levels, "g", 1.5)
    assert levels.level("g") == pytest.approx(1.05)
    for _ in range(50):
        _feed(levels, "g", 0.5)
    assert levels.level("g") == pytest.approx(1 / 1.05)


def test_one_stretched_op_does_not_move_the_level():
    levels = SpeedLevels(halflife_iters=1.0, max_drift=0.05)
    observed = np.ones(16)
    observed[3] = 10.0  # an interrupt in the middle of one op
    assert levels.update("g", observed, np.ones(16)) == 1.0


def test_zero_halflife_or_zero_drift_turns_levels_off():
    for levels in (SpeedLevels(halflife_iters=0.0), SpeedLevels(max_drift=0.0)):
        assert not levels.enabled
        assert _feed(levels, "g", 1.04) == 1.0 and levels.level("g") == 1.0


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="halflife_iters"):
        SpeedLevels(halflife_iters=-1)
    with pytest.raises(ValueError, match="max_drift"):
        SpeedLevels(max_drift=1.5)
    with pytest.raises(ValueError, match="--resihp-max-speed-drift"):
        ResiHPConfig(max_speed_drift=0.3)  # above slowdown_threshold - 1: it could hide a slowdown
    with pytest.raises(ValueError, match="--resihp-speed-level-halflife-iters"):
        ResiHPConfig(speed_level_halflife_iters=-2)


def _drifting(trace, amplitude=0.04, period=40):
    """Every group's ops take more and less device time together, as on a host whose cores drift;
    each group on its own phase (the timeline, and so the pipeline transfers, stays as it was)."""
    out = []
    for iteration, obs in trace:
        drifted = []
        for o in obs:
            factor = 1.0 + amplitude * math.sin(2 * math.pi * iteration / period + o.replica + 2 * o.stage)
            drifted.append(dataclasses.replace(o, busy=tuple(factor * b for b in o.op_busy())))
        out.append((iteration, tuple(drifted)))
    return tuple(out)


def test_detector_predicts_a_drifting_host_better_with_levels_and_stays_silent():
    trace = _drifting(cached_trace(200))
    mape = {}
    for halflife in (0.0, 2.0):
        det = FailSlowDetector(ResiHPConfig(speed_level_halflife_iters=halflife),
                               MicrobatchPredictor(error_window=10**7))
        det, events = run_detector(trace, detector=det)
        assert events == []
        mape[halflife] = det.predictor.mape()
    # The synthetic trace's own noise stays; what levels remove is the drift on top of it.
    assert mape[2.0] < 0.8 * mape[0.0], mape


def test_a_slowdown_is_found_even_when_the_level_sits_at_its_bound():
    # The group ran 5% slow (the most a level follows) for 60 iterations, then 1.5x slow.
    trace = list(cached_trace(80))
    slow_ranks = {SPEC.rank(0, 1, 0), SPEC.rank(0, 1, 1)}
    for i in range(len(trace)):
        factor = 1.05 * (1.5 if trace[i][0] >= 60 else 1.0)
        trace[i] = (trace[i][0], stretch_ops(trace[i][1], slow_ranks, factor))
    det = FailSlowDetector()
    suspicions = []
    for iteration, obs in trace:
        suspicion = det.observe(iteration, obs)
        if iteration == 59:
            assert det.levels.level((0, 1)) > 1.02  # the drift was followed before the fault
        if suspicion is not None:
            suspicions.append(suspicion)
            det.release(suspicion, iteration)
    assert suspicions and suspicions[0].stage == 1 and suspicions[0].replica == 0
    assert 60 <= suspicions[0].iteration <= 62
    assert suspicions[0].ratio == pytest.approx(1.5, rel=0.1)
    assert det.levels.level((0, 1)) <= 1.05 + 1e-9
