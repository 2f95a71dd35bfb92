"""Micro-batch predictor and iteration predictor: recovery of alpha/beta, robustness, errors."""

import numpy as np
import pytest

from resihp_ext.detection.predictor import MicrobatchPredictor, predict_replica, stage_keys_for
from resihp_ext.schedule import one_f_one_b
from resihp_ext.detection.simulator import simulate_iteration
from resihp_ext.workload import LengthDistribution, microbatch_features, sample_packed_workload

ALPHA, BETA = 5e-6, 6e-10


def _features(rng, n, seq_length=4096, per_mb=2):
    dist = LengthDistribution.parse("lognormal:median=300,sigma=1.3,min=16,max=4096")
    samples = sample_packed_workload(rng, dist, n * per_mb, seq_length)
    # (tokens, sum_sq): the tests below check the two-feature model callers get without document counts.
    return np.array([microbatch_features(samples[i * per_mb:(i + 1) * per_mb])[:2] for i in range(n)], dtype=float)


def test_recovers_alpha_beta_from_noisy_packed_data():
    rng = np.random.default_rng(0)
    feats = _features(rng, 400)
    y = (ALPHA * feats[:, 0] + BETA * feats[:, 1]) * rng.lognormal(0, 0.02, len(feats))
    pred = MicrobatchPredictor()
    for (n, s), t in zip(feats, y):
        pred.observe("k", n, s, t)
    coef = pred.coefficients("k")
    # N is constant under fixed-length packing, so alpha is pinned by the mean level, beta by the
    # spread of sum l_i^2; both must come back within a few percent.
    assert coef.alpha == pytest.approx(ALPHA, rel=0.03)
    assert coef.beta == pytest.approx(BETA, rel=0.05)
    assert pred.mape() < 3.0


def test_recovers_per_document_cost_when_it_outweighs_attention():
    # Small model: one attention run per document costs more than the quadratic term, so op time
    # falls as sum l^2 grows (what live CPU runs at hidden 64 show). The document count fixes it.
    rng = np.random.default_rng(2)
    dist = LengthDistribution.parse("lognormal:median=48,sigma=1.0,min=8,max=1024")
    samples = sample_packed_workload(rng, dist, 800, 64)
    feats = np.array([microbatch_features(samples[2 * i:2 * i + 2]) for i in range(400)], dtype=float)
    gamma = 1e-3
    y = (2e-5 * feats[:, 0] + 1e-8 * feats[:, 1] + gamma * feats[:, 2]) * rng.lognormal(0, 0.02, len(feats))
    assert np.corrcoef(feats[:, 1], y)[0, 1] < 0
    with_docs, without = MicrobatchPredictor(), MicrobatchPredictor()
    for part in (slice(0, 40), slice(40, None)):  # the second batch is scored before it is learnt
        f = feats[part]
        with_docs.observe_batch("k", f[:, 0], f[:, 1], y[part], num_docs=f[:, 2])
        without.observe_batch("k", f[:, 0], f[:, 1], y[part])
    assert with_docs.coefficients("k").gamma == pytest.approx(gamma, rel=0.05)
    assert without.coefficients("k").gamma == 0.0
    assert with_docs.mape() < 3.0 < without.mape()


def test_recovers_with_varying_token_counts():
    rng = np.random.default_rng(1)
    n = rng.integers(1000, 16000, 300).astype(float)
    s = n * rng.uniform(50, 3000, 300)
    y = ALPHA * n + BETA * s
    pred = MicrobatchPredictor()
    pred.observe_batch(("stage", 0, "F"), n, s, y)
    assert pred.coefficients(("stage", 0, "F")).alpha == pytest.approx(ALPHA, rel=1e-3)
    assert pred.coefficients(("stage", 0, "F")).beta == pytest.approx(BETA, rel=1e-3)
    assert pred.predict(("stage", 0, "F"), 8192, 1e7) == pytest.approx(ALPHA * 8192 + BETA * 1e7, rel=1e-3)


def test_warmup_outliers_do_not_bend_the_fit():
    rng = np.random.default_rng(2)
    feats = _features(rng, 200)
    y = (ALPHA * feats[:, 0] + BETA * feats[:, 1]) * rng.lognormal(0, 0.02, len(feats))
    y[0] *= 5.0  # first-iteration warm-up
    y[3] *= 3.0
    y[100] *= 4.0  # an occasional hiccup later on
    pred = MicrobatchPredictor()
    learnt = [pred.observe("k", n, s, t) for (n, s), t in zip(feats, y)]
    assert learnt[100] is False
    assert pred.coefficients("k").alpha == pytest.approx(ALPHA, rel=0.03)


def test_stale_fit_is_rebuilt_after_many_rejections():
    rng = np.random.default_rng(3)
    feats = _features(rng, 200)
    y = ALPHA * feats[:, 0] + BETA * feats[:, 1]
    pred = MicrobatchPredictor()
    pred.observe_batch("k", feats[:8, 0], feats[:8, 1], 3.0 * y[:8])  # fitted on warm-up only
    for (n, s), t in zip(feats[8:], y[8:]):
        pred.observe("k", n, s, t)
    assert pred.predict("k", *feats[0]) == pytest.approx(y[0], rel=0.02)


def test_reset_and_unfitted_key():
    pred = MicrobatchPredictor()
    with pytest.raises(KeyError, match="no fit"):
        pred.predict("a", 1, 1)
    assert pred.mape() is None
    n = np.linspace(1000, 9000, 20)
    for key in ("a", "b"):
        pred.observe_batch(key, n, n * 100, ALPHA * n + BETA * n * 100)
    pred.reset(["a"])
    assert not pred.fitted("a") and pred.fitted("b")
    pred.reset()
    assert not pred.fitted("b")


def test_bad_input_raises():
    with pytest.raises(ValueError, match="min_samples"):
        MicrobatchPredictor(min_samples=1)
    with pytest.raises(ValueError, match="seconds > 0"):
        MicrobatchPredictor().observe("k", 10, 10, 0.0)


def test_iteration_prediction_walks_the_schedule():
    pred = MicrobatchPredictor()
    n = np.linspace(2000, 9000, 16)
    s = n * np.linspace(100, 2000, 16)
    keys = stage_keys_for(2, 4)
    for stage, (fkey, bkey) in enumerate(keys):
        scale = 1.0 + 0.2 * stage
        pred.observe_batch(fkey, n, s, scale * (ALPHA * n + BETA * s))
        pred.observe_batch(bkey, n, s, 2 * scale * (ALPHA * n + BETA * s))
    feats = [(8192, 1e7), (8192, 4e7), (8192, 2e6)]
    out = predict_replica(pred, keys, feats, p2p_s=0.001, allreduce_s=0.01)
    base = [ALPHA * a + BETA * b for a, b in feats]
    fwd = [[1.0 * t for t in base], [1.2 * t for t in base]]
    bwd = [[2.0 * t for t in base], [2.4 * t for t in base]]
    expected = simulate_iteration(one_f_one_b(2, 3), fwd, bwd, 0.001, 0.01)
    assert out.total_s == pytest.approx(expected.total_s, rel=1e-6)
    assert out.stage_busy_s[1] == pytest.approx(sum(fwd[1]) + sum(bwd[1]), rel=1e-6)


def test_predicted_op_times_follow_each_keys_fit_and_wait_for_every_fit():
    predictor = MicrobatchPredictor()
    rng = np.random.default_rng(3)
    feats = _features(rng, 40)
    for key, scale in (("F", 1.0), ("B", 2.0)):
        for n, s in feats:
            predictor.observe(key, n, s, scale * (ALPHA * n + BETA * s))
    table = np.column_stack([feats, np.zeros(len(feats))])
    fwd, bwd = predictor.predict_ops(("F", "B"), table, scale=1.5)
    assert fwd == pytest.approx(1.5 * (ALPHA * feats[:, 0] + BETA * feats[:, 1]), rel=1e-3)
    assert bwd == pytest.approx(2.0 * fwd, rel=1e-3)
    assert predictor.predict_ops(("F", "not seen"), table) is None
