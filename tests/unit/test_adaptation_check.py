"""Whether a re-plan paid, and what a rolled-back one does to later plans (resihp_ext.planner.adaptation_check)."""

import pytest

from resihp_ext.detection.validation import Verdict, VerdictKind
from resihp_ext.layout import Layout, ModelSpec, replica_shape
from resihp_ext.planner import HardwareModel, Health
from resihp_ext.planner.adaptation_check import AdaptationTrial, RejectedPlans
from resihp_ext.planner.fail_slow import decide_fail_slow, misjudged

MODEL = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                  vocab_size=32768, seq_length=1024, micro_batch_size=1, global_batch_size=64)
LAYOUT = Layout.uniform(MODEL, tp_degree=4, pp_degree=4, dp_degree=2)  # 32 ranks, 2 replicas
EVEN = (32, 32)
SHAPE = replica_shape(LAYOUT.replicas[0])


def _trial(before_s=1.0, predicted_after_s=0.6, **kw) -> AdaptationTrial:
    return AdaptationTrial(iteration=12, before_s=before_s, predicted_before_s=1.2, predicted_after_s=predicted_after_s,
                           old_layout=LAYOUT, old_quotas=EVEN, new_layout=LAYOUT, new_quotas=(40, 24), **kw)


def _slow(rank: int, factor: float) -> Verdict:
    return Verdict(VerdictKind.COMPUTE, (rank,), factor, 10, {}, "probed slow", probe_factors={rank: factor})


def test_a_trial_waits_for_its_window_and_never_measures_the_settling_iteration():
    trial = _trial(window_iters=3)
    assert trial.iterations_needed == 4
    assert trial.judge([9.0, 0.7, 0.7]) is None
    verdict = trial.judge([9.0, 0.7, 0.8, 0.6])  # the first, on rebuilt objects, is not counted
    assert verdict.keep and verdict.measured_after_s == pytest.approx(0.7)
    assert verdict.prediction_error == pytest.approx(0.7 / 0.6 - 1)


def test_a_replan_after_which_the_job_is_slower_or_no_faster_is_rolled_back():
    slower = _trial().judge([1.0, 1.4, 1.5, 1.3])
    assert not slower.keep and "rolled back" in slower.reason and "1.400 s" in slower.reason
    # Faster, but by less than the noise margin: it did not pay for the change.
    level = _trial(margin=0.05).judge([1.0, 0.97, 0.98, 0.96])
    assert not level.keep


def test_a_replan_that_paid_but_missed_its_prediction_is_kept_and_its_error_recorded():
    # Going back would make the job slower than it is now; the cost model's miss is what to learn.
    verdict = _trial(before_s=1.0, predicted_after_s=0.4).judge([1.0, 0.8, 0.8, 0.8])
    assert verdict.keep and verdict.prediction_error == pytest.approx(1.0)


def test_bad_trial_settings_are_refused():
    for bad in ({"window_iters": 0}, {"settle_iters": -1}, {"margin": 1.0}):
        with pytest.raises(ValueError):
            _trial(**bad)
    with pytest.raises(ValueError, match="before_s"):
        _trial(before_s=0.0)


def test_a_rolled_back_change_is_not_chosen_again_from_the_same_start():
    verdict = _slow(16, 2.0)
    first = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE)
    assert first.plan.action == "adapt"
    trial = AdaptationTrial(iteration=12, before_s=1.0, predicted_before_s=first.plan.iteration_s_before,
                            predicted_after_s=first.plan.iteration_s_after, old_layout=LAYOUT, old_quotas=EVEN,
                            new_layout=first.plan.layout, new_quotas=first.plan.quotas)
    rejected = RejectedPlans().with_rollback(trial, trial.judge([1.0, 1.5, 1.5, 1.5]))
    assert rejected.errors and rejected.rejects(LAYOUT, EVEN, first.plan.layout, first.plan.quotas)
    again = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE, rejected=rejected)
    assert again.plan.action == "keep" and "rolled back before" in again.plan.reason
    assert again.known == first.known  # the slowdown is still known; only the change is refused
    # From another starting point the same target is another change, and may be made.
    other = (30, 34)
    assert not rejected.rejects(LAYOUT, other, first.plan.layout, first.plan.quotas)


def test_a_misjudged_rank_misleads_the_plan_but_not_what_the_detector_expects():
    assert misjudged(Health(speed={3: 0.5}), {3: 2.0, 0: 10.0}).speed == {3: 0.25, 0: pytest.approx(0.1)}
    assert misjudged(Health(dead=frozenset({0})), {0: 10.0}).speed == {}
    verdict = _slow(16, 2.0)
    truthful = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE)
    # Told that a healthy rank of the other replica is 10x slow, the plan sends work the wrong way.
    healthy = 4
    assert LAYOUT.replica_of(healthy) != LAYOUT.replica_of(16)
    misled = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE,
                              misjudge={healthy: 10.0})
    assert truthful.plan.quotas[LAYOUT.replica_of(16)] <= truthful.plan.quotas[LAYOUT.replica_of(healthy)]
    assert misled.plan.quotas[LAYOUT.replica_of(16)] > misled.plan.quotas[LAYOUT.replica_of(healthy)]
    assert misled.expected == truthful.expected and misled.known == truthful.known
