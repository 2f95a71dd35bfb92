"""What a fail-slow re-plan decides from typed verdicts (resihp_ext.planner.fail_slow)."""

import pytest

from resihp_ext.detection.validation import Verdict, VerdictKind, fail_stop_verdict
from resihp_ext.layout import Layout, ModelSpec, replica_shape
from resihp_ext.planner import HardwareModel, Health
from resihp_ext.planner.calibration import ComputeCosts
from resihp_ext.planner.fail_slow import IN_PLACE_REGROUP_S, decide_fail_slow, live_hardware, verdict_health

MODEL = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                  vocab_size=32768, seq_length=1024, micro_batch_size=1, global_batch_size=64)
LAYOUT = Layout.uniform(MODEL, tp_degree=4, pp_degree=4, dp_degree=2)  # 32 ranks, 2 replicas
EVEN = (32, 32)
SHAPE = replica_shape(LAYOUT.replicas[0])


def _compute(ranks, factor, probe_factors=None, **typed) -> Verdict:
    return Verdict(VerdictKind.COMPUTE, tuple(ranks), factor, 10, {}, "probed slow",
                   probe_factors=probe_factors or {}, **typed)


def test_the_kind_is_an_enum_that_still_reads_as_its_name():
    verdict = Verdict("link", (1, 3), 4.0, 10)
    assert verdict.kind is VerdictKind.LINK and verdict.kind == "link" and verdict.to_event()["kind"] == "link"
    assert [k.value for k in VerdictKind if k.fail_slow] == ["compute", "link", "recovered"]
    with pytest.raises(ValueError, match="compute|link"):
        Verdict("slow", (1,), 2.0, 10)


def test_each_rank_plans_at_its_own_probe_factor_and_an_unprobed_one_at_the_verdicts():
    health = verdict_health(_compute((16, 17), 2.0, {16: 2.0, 17: 1.25}))
    assert health.speed == {16: 0.5, 17: 0.8} and health.bursts == frozenset()
    assert verdict_health(_compute((16,), 1.6)).speed == {16: pytest.approx(1 / 1.6)}
    # A recovered rank at 0.9x (faster than healthy) plans at full speed.
    assert verdict_health(Verdict("recovered", (16,), 1.0, 10, probe_factors={16: 0.9})).speed == {16: 1.0}


def test_a_link_verdict_slows_its_link_and_a_burst_verdict_marks_its_ranks_bursty():
    assert verdict_health(Verdict("link", (1, 3), 4.0, 10)).slow_links == {(1, 3): 0.25}
    bursty = verdict_health(_compute((16,), 1.5, {16: 1.5}, intermittent=True, slow_share=0.5))
    assert bursty.bursts == {16} and bursty.speed == {16: pytest.approx(1 / 1.5)}


def test_a_fail_stop_verdict_is_not_planned_here():
    with pytest.raises(ValueError, match="fail-stop"):
        verdict_health(fail_stop_verdict("dead", [3], 10))


def test_a_steady_slowdown_adapts_and_every_later_plan_starts_from_it():
    known = Health(speed={0: 0.8})  # acted on earlier in this world
    decision = decide_fail_slow(LAYOUT, known, [_compute((16,), 2.0, {16: 2.0})], HardwareModel(), EVEN, 500, SHAPE)
    assert decision.plan.action == "adapt"
    assert decision.known.slow_factors == {0: 1.25, 16: 2.0} and decision.expected == decision.known
    assert decision.watch_ranks == () and decision.watch_links == ()


def test_rare_bursts_not_worth_a_plan_are_expected_but_not_planned_around():
    verdict = _compute((16,), 2.0, {16: 2.0}, intermittent=True, slow_share=0.0)
    decision = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE)
    assert decision.plan.action == "keep"
    assert decision.known == Health()  # later plans do not see the bursts
    assert decision.expected.slow_factors == {16: 2.0} and decision.expected.bursts == {16}  # the detector does
    assert decision.watch_ranks == (16,) and decision.watch_links == ()


def test_an_unmeasured_share_of_bursts_counts_as_always_slow():
    verdict = _compute((16,), 2.0, {16: 2.0}, intermittent=True)
    decision = decide_fail_slow(LAYOUT, Health(), [verdict], HardwareModel(), EVEN, 500, SHAPE)
    assert decision.plan.action == "adapt" and decision.known.bursts == {16}


def test_the_live_cost_model_charges_the_in_place_regroup_and_the_measured_facts():
    hw = live_hardware(None, half_precision=True, link_bandwidth_Bps=1e9)
    assert hw.regroup_s == IN_PLACE_REGROUP_S < HardwareModel().regroup_s
    assert hw.activation_bytes_per_value == 2.0 and hw.link_bandwidth_Bps == 1e9
    costs = ComputeCosts(iteration=5, layer_forward_s=0.003, output_forward_s=None, backward_factor=2.0)
    fitted = live_hardware(costs, False)
    assert fitted.layer_forward_s == 0.003 and fitted.regroup_s == IN_PLACE_REGROUP_S
    assert fitted.activation_bytes_per_value == 4.0
