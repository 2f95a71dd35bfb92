"""Known slowdowns: a slowdown a plan kept is the norm, and only a further change (slower still,
or fast again) alarms; a group or link watched again after a kept verdict."""

import pytest

from resihp_ext.detection.detector import Cleared, FailSlowDetector, Verdict
from resihp_ext.faults import parse_fault
from resihp_ext.detection.traces import synthetic_probes, synthetic_trace
from tests.unit.detector_runs import SPEC, busy_ops, cached_trace, run_detector


def test_a_known_slowdown_is_the_norm_and_only_a_further_one_alarms():
    # Rank 5 runs 2x slow from the start, as a re-plan already knows; at iteration 60 it slows to 4x.
    known, worse = "slow:rank=5,factor=2.0,at=1", "slow:rank=5,factor=4.0,at=60"
    det = FailSlowDetector()
    det.expect({5: 2.0})
    _, events = run_detector(cached_trace(58, (known,)), (known,), detector=det)
    assert events == []  # without expect(), rank 5's group is suspected (below)
    _, unaware = run_detector(cached_trace(58, (known,)), (known,))
    assert unaware and unaware[0][0].ranks == (4, 5)
    det = FailSlowDetector()
    det.expect({5: 2.0})
    _, events = run_detector(cached_trace(70, (known, worse)), (known, worse), detector=det)
    assert len(events) == 1
    suspicion, verdict = events[0]
    assert 60 <= suspicion.iteration <= 63 and suspicion.ratio == pytest.approx(2.0, rel=0.25)
    assert isinstance(verdict, Verdict) and verdict.ranks == (5,) and verdict.factor == pytest.approx(4.0, rel=0.2)


@pytest.mark.parametrize("probed_factor, named", [(2.0, False), (3.0, True)])
def test_a_known_slow_rank_is_named_again_only_when_its_probe_shows_it_slower_still(probed_factor, named):
    # Rank 5 is known 2x slow; its group's iterations run 3x from 60. Probes reading the known 2x
    # (the iterations slowed for another reason) clear it; probes reading 3x (1.5x more) name it.
    known, worse = "slow:rank=5,factor=2.0,at=1", "slow:rank=5,factor=3.0,at=60"
    det = FailSlowDetector()
    det.expect({5: 2.0})
    suspicion = next(s for i, obs in cached_trace(70, (known, worse)) if (s := det.observe(i, obs)) is not None)
    assert 5 in suspicion.ranks and suspicion.iteration >= 60
    probed = (known, worse) if named else (known,)
    outcome = det.conclude(suspicion, synthetic_probes(SPEC, [parse_fault(f) for f in probed], suspicion.iteration,
                                                       suspicion.probe_ranks, suspicion.probe_links))
    assert outcome.evidence["known_factors"] == {"5": 2.0}
    if named:
        assert isinstance(outcome, Verdict) and outcome.ranks == (5,)
        assert outcome.factor == pytest.approx(probed_factor, rel=0.1)
    else:
        assert isinstance(outcome, Cleared) and "slower than its known slowdown" in outcome.reason, outcome
        assert outcome.evidence["probe_factors"]["5"] == pytest.approx(probed_factor, rel=0.1)


def test_a_known_slow_rank_that_recovers_is_named_faster_again():
    # Rank 5 ran 2x slow until iteration 60, as a re-plan knows; then it is healthy again.
    gone = "slow:rank=5,factor=2.0,at=1,until=60"
    det = FailSlowDetector()
    det.expect({5: 2.0})
    _, events = run_detector(cached_trace(70, (gone,)), (gone,), detector=det)
    assert len(events) == 1, events
    suspicion, verdict = events[0]
    assert suspicion.kind == "recovery" and suspicion.ranks == (5,) and 60 <= suspicion.iteration <= 63
    assert suspicion.ratio == pytest.approx(2.0, rel=0.25)  # 2x faster than the known slowdown predicts
    assert isinstance(verdict, Verdict) and verdict.kind == "recovered" and verdict.ranks == (5,)
    assert verdict.factor == pytest.approx(1.0, abs=0.15) and verdict.evidence["known_factors"] == {"5": 2.0}
    # Partly recovered (known 4x, now 2x): named with its slowdown now.
    still = "slow:rank=5,factor=2.0,at=1"
    det = FailSlowDetector()
    det.expect({5: 4.0})
    _, events = run_detector(cached_trace(30, (still,)), (still,), detector=det)
    # The shared stage-1 fit starts from both replicas, one of them 2x faster than its known
    # slowdown says, so the healthy replica may look slow for an iteration; its probes clear it.
    named = [v for _, v in events if isinstance(v, Verdict)]
    assert all(isinstance(v, Cleared) and 5 not in v.ranks for _, v in events if not isinstance(v, Verdict)), events
    assert named and named[0].kind == "recovered" and named[0].factor == pytest.approx(2.0, rel=0.1)
    # Faster ops but probes that still find the old slowdown: dropped.
    det = FailSlowDetector()
    det.expect({5: 2.0})
    _, events = run_detector(cached_trace(70, (gone,)), (still,), detector=det)
    assert events and isinstance(events[0][1], Cleared), events
    assert "no rank faster than its known slowdown" in events[0][1].reason


def _in_a_host_spell(fault: str, host: float):
    """The detector, told rank 5 is 2x slow, over 70 iterations of ``fault`` in which every rank's
    device works ``host`` times as long as the model learnt from iteration 40 on (a shared host's
    fast or slow spell): the detector and its suspicions with their outcomes."""
    trace = list(cached_trace(70, (fault,)))
    for i in range(40, 70):
        trace[i] = (trace[i][0], busy_ops(trace[i][1], {r: host for r in range(8)}))
    det = FailSlowDetector()
    det.expect({5: 2.0})
    return run_detector(trace, (fault,), detector=det)


@pytest.mark.parametrize("host", [0.75, 1.3])
def test_a_host_running_faster_or_slower_than_the_model_does_not_make_a_known_slow_rank_look_recovered(host):
    # The known group reads 0.75x (or 1.3x) its known slowdown, as every other group reads its
    # prediction. Judged on its own ratio the 0.75x reads as a recovery every few iterations, each
    # costing a probe round.
    det, events = _in_a_host_spell("slow:rank=5,factor=2.0,at=1", host)
    assert det.last_report.stage_ratio[(0, 1)] == pytest.approx(host, rel=0.15)
    assert events == [], events
    # A recovery during the spell is still one: rank 5 healthy again from 55.
    _, events = _in_a_host_spell("slow:rank=5,factor=2.0,at=1,until=55", host)
    assert events and events[0][0].kind == "recovery" and 55 <= events[0][0].iteration <= 58, events
    assert isinstance(events[0][1], Verdict) and events[0][1].kind == "recovered"


def _kept(faults, on_verdict, iterations: int = 100):
    """The detector over ``faults``, each suspicion concluded by its probes and each verdict handed
    to ``on_verdict(detector, verdict)``, as a plan that kept the layout would; the suspicions
    raised and the verdicts."""
    det = FailSlowDetector()
    raised, verdicts = [], []
    for iteration, obs in synthetic_trace(SPEC, iterations, faults, seed=5):
        suspicion = det.observe(iteration, obs)
        if suspicion is None:
            continue
        raised.append(suspicion)
        outcome = det.conclude(suspicion, synthetic_probes(SPEC, faults, iteration, suspicion.probe_ranks,
                                                           suspicion.probe_links))
        if isinstance(outcome, Verdict):
            verdicts.append(outcome)
            on_verdict(det, outcome)
    return raised, verdicts


def _expect_and_watch(det, verdict):
    det.expect({r: verdict.factor for r in verdict.ranks})
    det.watch_again(verdict.ranks)


@pytest.mark.parametrize("watch", [True, False])
def test_a_group_watched_again_after_a_kept_verdict_alarms_only_when_its_rank_slows_further(watch):
    faults = [parse_fault("slow:rank=5,factor=2,at=40,until=70"), parse_fault("slow:rank=5,factor=4,at=70")]
    raised, _ = _kept(faults, _expect_and_watch if watch else lambda det, verdict: None)
    assert raised and raised[0].iteration < 45 and 5 in raised[0].ranks
    later = [s for s in raised[1:] if 5 in s.ranks]
    if watch:  # 2x expected: quiet until the rank slows to 4x
        assert later and all(s.iteration >= 70 for s in later) and later[0].iteration <= 73, raised
    else:  # muted since its first verdict
        assert later == [], raised


@pytest.mark.parametrize("watch", [True, False])
def test_a_link_watched_again_after_a_kept_verdict_alarms_only_when_it_slows_further(watch):
    # From 75 the second fault stands for the link (the later of two active faults of a link wins).
    faults = [parse_fault("link:src=1,dst=5,factor=4,at=40"), parse_fault("link:src=1,dst=5,factor=12,at=75")]
    raised, verdicts = _kept(faults, (lambda det, verdict: det.watch_again((), links=[verdict.ranks])) if watch
                             else (lambda det, verdict: None))
    assert verdicts and verdicts[0].kind == "link" and set(verdicts[0].ranks) == {1, 5} and raised[0].iteration < 45
    # Both directions of the link are named, each by its own suspicion, at 41 and 42.
    assert {s.links[0] for s in raised if s.iteration < 45} == {(1, 5), (5, 1)}, raised
    later = [s for s in raised if s.kind == "link" and s.iteration >= 45]
    if watch:  # the 4x link is its new norm: quiet until it slows to 12x, 3x more
        assert later and all(s.iteration >= 75 for s in later) and later[0].iteration <= 78, raised
        assert set(verdicts[-1].ranks) == {1, 5} and verdicts[-1].iteration >= 75
    else:  # muted since its first verdict
        assert later == [], raised
