"""The iteration predictor: the simulated schedule, scaled by contention, plus learnt overhead."""

import numpy as np
import pytest

from resihp_ext.detection.iteration_estimate import IterationEstimate
from resihp_ext.detection.predictor import MicrobatchPredictor, predict_replica, stage_keys_for

ALPHA, BETA = 2e-6, 1e-10
FEATS = np.array([(8192, 1e7, 4), (8192, 4e7, 2), (8192, 2e6, 9)], dtype=float)


def _two_stage_replica():
    pred = MicrobatchPredictor()
    n = np.linspace(2000, 9000, 16)
    s = n * np.linspace(100, 2000, 16)
    keys = stage_keys_for(2, 1)
    for fkey, bkey in keys:
        pred.observe_batch(fkey, n, s, ALPHA * n + BETA * s)
        pred.observe_batch(bkey, n, s, 2 * (ALPHA * n + BETA * s))
    return pred, {(0, stage): keys[stage] for stage in range(2)}


def _predict(estimate, pred, keys, observed_s, contention=1.0, level=1.0):
    return estimate.predict(pred, keys, {0: FEATS}, lambda g: level, lambda up, down: 0.002, observed_s,
                            contention, threshold=1.25)


def test_the_schedule_plus_the_overhead_learnt_from_healthy_iterations():
    pred, keys = _two_stage_replica()
    span = predict_replica(pred, list(keys.values()), FEATS, [0.002]).total_s
    estimate = IterationEstimate(history=8)
    assert _predict(estimate, pred, keys, span + 0.05) == pytest.approx(span)  # nothing learnt yet
    for _ in range(3):
        _predict(estimate, pred, keys, span + 0.05)
    assert _predict(estimate, pred, keys, span + 0.05) == pytest.approx(span + 0.05)
    # A slow iteration (2x) once the estimate has settled teaches nothing, so it never becomes the norm.
    for _ in range(10):
        _predict(estimate, pred, keys, 2 * (span + 0.05))
    assert _predict(estimate, pred, keys, span + 0.05) == pytest.approx(span + 0.05)


def test_ops_are_scaled_by_the_typical_contention_and_the_group_level():
    pred, keys = _two_stage_replica()
    span = predict_replica(pred, list(keys.values()), FEATS, [0.002]).total_s
    shared = IterationEstimate(history=8)
    assert shared.typical_contention(3.0) == 3.0  # nothing seen: this iteration's own
    for _ in range(4):
        _predict(shared, pred, keys, 3 * span, contention=3.0)
    assert shared.typical_contention(1.0) == 3.0
    def scaled(factor):
        return predict_replica(pred, list(keys.values()), FEATS, [0.002], op_scale=[factor, factor]).total_s

    overhead = 3 * span - scaled(3.0)  # the p2p transfers are not scaled, so a little is left over
    assert overhead > 0
    assert _predict(shared, pred, keys, 3 * span, level=1.5) == pytest.approx(scaled(4.5) + overhead)


def test_a_replica_missing_a_stage_is_not_predicted():
    pred, keys = _two_stage_replica()
    assert IterationEstimate(8).predict(pred, {(0, 1): keys[(0, 1)]}, {0: FEATS}, lambda g: 1.0,
                                        lambda up, down: 0.0, 1.0, 1.0, 1.25) is None
