"""A rank slow in bursts shorter than the confirmation wait gets a verdict (resihp_ext.detection.recurrence)."""

import pytest

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.confirmation import PendingVerdicts
from resihp_ext.detection.detector import Cleared, FailSlowDetector, Verdict
from resihp_ext.faults import parse_fault
from resihp_ext.detection.recurrence import Recurrences
from resihp_ext.detection.traces import synthetic_probes, synthetic_trace
from tests.unit.detector_runs import SPEC

# Rank 5 (replica 0, stage 1): 1.5x for 3 iterations, healthy for 3, from iteration 40.
BURSTS = parse_fault("slow:rank=5,factor=1.5,at=40,on=3,off=3")


def _dropped(rank: int, probe_iteration: int, factor: float = 1.5, kind: str = "compute") -> Verdict:
    evidence = {"probe_factors": {str(rank): factor}, "suspicion_iteration": probe_iteration - 1,
                "probe_iteration": probe_iteration}
    return Verdict(kind, (rank,), factor, probe_iteration - 2, evidence, "first round", probe_factors={rank: factor})


def test_the_third_dropped_verdict_of_a_rank_within_the_window_names_it_at_its_median_burst_factor():
    seen = Recurrences(episodes=3, window_iters=30)
    assert seen.note(_dropped(5, 41, 1.45), {5: 1.01}, 43) is None
    assert seen.note(_dropped(4, 44, 1.9), {4: 1.0}, 46) is None  # another rank counts on its own
    assert seen.note(_dropped(5, 47, 1.60), {5: 0.99}, 49) is None
    asked = []
    verdict = seen.note(_dropped(5, 53, 1.50), {5: 1.02}, 55, lambda first, last: asked.append((first, last)) or 0.5)
    assert asked == [(39, 50)]  # the first burst's onset up to the last one's: whole periods
    assert verdict.slow_share == 0.5 and verdict.evidence["slow_share"] == 0.5
    assert isinstance(verdict, Verdict) and verdict.kind == "compute" and verdict.ranks == (5,)
    assert verdict.factor == pytest.approx(1.50)
    assert verdict.iteration == 39  # the first burst's onset
    assert verdict.intermittent is True and verdict.evidence["intermittent"] is True
    assert [e["probe"] for e in verdict.evidence["episodes"]["5"]] == [41, 47, 53]
    assert [e["factor_after"] for e in verdict.evidence["episodes"]["5"]] == [1.01, 0.99, 1.02]
    assert verdict.probe_factors == {5: 1.5}  # what a plan reads the rank's speed from
    assert verdict.evidence["probe_factors"] == {"5": 1.5}
    assert "slow in bursts" in verdict.reason
    # Its episodes are spent: the next burst starts a new count.
    assert seen.note(_dropped(5, 59), {}, 61) is None


def test_episodes_further_apart_than_the_window_never_add_up():
    seen = Recurrences(episodes=3, window_iters=10)
    assert all(seen.note(_dropped(5, it), {}, it + 2) is None for it in (41, 52, 63, 74, 85))


def test_only_compute_verdicts_count_and_zero_episodes_turns_it_off():
    links = Recurrences(episodes=2, window_iters=50)
    assert all(links.note(_dropped(5, it, kind="link"), {}, it + 2) is None for it in (41, 47, 53))
    off = Recurrences(episodes=0, window_iters=50)
    assert all(off.note(_dropped(5, it), {}, it + 2) is None for it in (41, 47, 53))


@pytest.mark.parametrize("episodes, window, flag", [(1, 50, "--resihp-intermittent-episodes"),
                                                    (-1, 50, "--resihp-intermittent-episodes"),
                                                    (3, 0, "--resihp-intermittent-window-iters")])
def test_bad_settings_name_their_flag(episodes, window, flag):
    with pytest.raises(ValueError, match=flag):
        Recurrences(episodes, window)
    with pytest.raises(ValueError, match=flag):
        ResiHPConfig(intermittent_episodes=episodes, intermittent_window_iters=window)


def _run(config: ResiHPConfig, faults, iterations: int = 90):
    """The detector over a synthetic TP2/PP2/DP2 trace, probed as the live job probes: the decider
    plans the probes after judging an iteration, and every rank runs them after the next one."""
    detector, pending = FailSlowDetector(config), PendingVerdicts.from_config(config)
    settled, plan = [], None
    for iteration, observations in synthetic_trace(SPEC, iterations, faults, seed=5):
        if plan is not None:
            rounds = [synthetic_probes(SPEC, faults, iteration, s.probe_ranks, s.probe_links) for s in plan.subjects]
            settled += [(iteration, o) for _, o in pending.settle_probed(detector, iteration, plan, rounds)]
        plan = pending.plan_probes(iteration + 1, detector.observe(iteration, observations))
    return settled


def test_a_rank_slow_in_bursts_is_named_after_three_dropped_verdicts():
    settled = _run(ResiHPConfig(), [BURSTS])
    verdicts = [(i, o) for i, o in settled if isinstance(o, Verdict)]
    assert verdicts, settled
    acted_at, verdict = verdicts[0]
    dropped = [i for i, o in settled if isinstance(o, Cleared) and i < acted_at]
    assert len(dropped) == 2  # the first two bursts, each dropped by its second round
    assert verdict.kind == "compute" and verdict.ranks == (5,) and verdict.intermittent
    assert verdict.factor == pytest.approx(1.5, rel=0.2)
    assert verdict.slow_share == pytest.approx(0.5, abs=0.1)  # 3 iterations in 6
    assert acted_at < 40 + 6 * 5, acted_at  # within five bursts
    assert len(verdicts) == 1  # the group is muted, as after any verdict, until a re-plan


def test_without_recurrence_every_burst_is_dropped_and_nothing_is_named():
    settled = _run(ResiHPConfig(intermittent_episodes=0), [BURSTS])
    assert settled and not any(isinstance(o, Verdict) for _, o in settled), settled
    assert sum(isinstance(o, Cleared) for _, o in settled) >= 3


def test_a_steady_slowdown_is_confirmed_as_before_not_as_bursts():
    settled = _run(ResiHPConfig(), [parse_fault("slow:rank=5,factor=1.5,at=40")], iterations=60)
    verdicts = [o for _, o in settled if isinstance(o, Verdict)]
    assert verdicts and verdicts[0].ranks == (5,) and not verdicts[0].intermittent


def _suspicions(expect_bursts: bool, faults, iterations: int = 100):
    detector = FailSlowDetector()
    detector.expect({5: 1.5}, bursts={5} if expect_bursts else ())
    raised = []
    for iteration, observations in synthetic_trace(SPEC, iterations, faults, seed=5):
        suspicion = detector.observe(iteration, observations)
        if suspicion is not None:
            raised.append(suspicion)
            detector.release(suspicion, iteration)  # probes cleared it: watch on
    return raised


def test_a_rank_known_to_be_slow_in_bursts_raises_nothing_while_its_bursts_stay_as_known():
    known_from_start = parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=3")
    assert _suspicions(True, [known_from_start]) == []
    # Known as a plain 1.5x slowdown instead, every calm spell looks like a recovery.
    assert any(s.kind == "recovery" for s in _suspicions(False, [known_from_start]))


def test_bursts_worse_than_the_known_ones_are_suspected():
    worse = [parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=3,until=61"),
             parse_fault("slow:rank=5,factor=2.5,at=61,on=3,off=3")]
    raised = _suspicions(True, worse)
    assert raised and all(s.kind == "compute" and 5 in s.ranks and s.iteration >= 61 for s in raised), raised


def _first_recovery(faults, iterations: int, window: int = 40):
    """The detector told rank 5 is slow in bursts; its first recovery suspicion, concluded with the
    probes the faults would give, or None."""
    detector = FailSlowDetector(ResiHPConfig(intermittent_window_iters=window))
    detector.expect({5: 1.5}, bursts={5})
    for iteration, observations in synthetic_trace(SPEC, iterations, faults, seed=5):
        suspicion = detector.observe(iteration, observations)
        if suspicion is None:
            continue
        assert suspicion.kind == "recovery", suspicion
        probes = synthetic_probes(SPEC, faults, iteration + 1, suspicion.probe_ranks, suspicion.probe_links)
        return suspicion, detector.conclude(suspicion, probes)
    return None


@pytest.mark.parametrize("spike", [False, True], ids=["calm", "one_noisy_iteration"])
def test_a_rank_whose_bursts_stop_for_a_whole_window_is_found_fast_again(spike):
    stopped = [parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=3,until=31")]
    if spike:  # one slow iteration is noise, not a burst: the calm goes on
        stopped.append(parse_fault("slow:rank=5,factor=2,at=50,until=51"))
    found = _first_recovery(stopped, iterations=90)
    assert found is not None
    suspicion, verdict = found
    assert suspicion.ranks == (5,) and suspicion.onset_iteration == 28  # the last burst was 25-27
    assert suspicion.iteration == suspicion.onset_iteration + 40 - 1  # a whole window without a burst
    assert isinstance(verdict, Verdict) and verdict.kind == "recovered" and verdict.ranks == (5,)
    assert verdict.factor == pytest.approx(1.0, abs=0.15)
    assert "slow in bursts" in suspicion.reason and "no burst in its group since iteration 28" in verdict.reason


def test_a_rank_still_bursting_is_never_suspected_of_recovery():
    assert _first_recovery([parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=9")], iterations=90) is None
    # Nor with the feature that names recoveries turned off.
    stopped = [parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=3,until=31")]
    detector = FailSlowDetector(ResiHPConfig(intermittent_window_iters=40, no_recovery=True))
    detector.expect({5: 1.5}, bursts={5})
    assert all(detector.observe(i, obs) is None for i, obs in synthetic_trace(SPEC, 90, stopped, seed=5))


def test_a_recovery_the_probes_did_not_confirm_is_asked_again_after_the_cooldown_not_a_window():
    """Live, a shared host's probe once read the recovered rank at 1.29x, too close to its 1.53x
    bursts for a verdict; the calm it had shown still stood."""
    stopped = [parse_fault("slow:rank=5,factor=1.5,at=1,on=3,off=3,until=31")]
    still_bursting = [parse_fault("slow:rank=5,factor=1.5,at=1")]
    detector = FailSlowDetector(ResiHPConfig(intermittent_window_iters=40))
    detector.expect({5: 1.5}, bursts={5})
    asked = []
    for iteration, observations in synthetic_trace(SPEC, 90, stopped, seed=5):
        suspicion = detector.observe(iteration, observations)
        if suspicion is None:
            continue
        asked.append(iteration)
        probed_as = still_bursting if len(asked) == 1 else stopped  # the first probes catch it slow
        outcome = detector.conclude(suspicion, synthetic_probes(SPEC, probed_as, iteration + 1,
                                                                suspicion.probe_ranks, suspicion.probe_links))
        if isinstance(outcome, Verdict):
            break
    assert isinstance(outcome, Verdict) and outcome.kind == "recovered", asked
    assert asked[0] == 28 + 40 - 1 and asked[1] <= asked[0] + ResiHPConfig().cleared_cooldown_iters + 1, asked
