"""Validation probes: how a round's timings name slow ranks (against peers, or a device's own
healthy probe), how noisy samples are read, and a rank that does not answer."""

import pytest

from resihp_ext.detection.detector import Cleared, FailSlowDetector, Verdict
from resihp_ext.faults import parse_fault
from resihp_ext.detection.traces import SyntheticSpec, synthetic_probes, synthetic_trace
from resihp_ext.detection.validation import ProbeResults, localise, pass_normalised_times, peer_reference_s, undecided
from tests.unit.detector_runs import SPEC, cached_trace


def test_unresponsive_rank_in_probes_is_a_hang():
    fault = "slow:rank=5,factor=1.5,at=30"
    det = FailSlowDetector()
    for iteration, obs in cached_trace(40, (fault,)):
        suspicion = det.observe(iteration, obs)
        if suspicion:
            break
    outcome = det.conclude(suspicion, ProbeResults(iteration, {4: 0.01}, unresponsive=frozenset({5})))
    assert outcome.kind == "hang" and outcome.ranks == (5,)


def test_localise_names_slow_rank_and_factor():
    loc = localise(ProbeResults(1, {0: 0.010, 1: 0.0101, 2: 0.0302, 3: 0.0099}), threshold=1.2)
    assert loc.slow_ranks == (2,)
    assert loc.rank_factors[2] == pytest.approx(3.0, rel=0.02)
    with pytest.raises(ValueError, match="threshold"):
        localise(ProbeResults(1, {0: 1.0}), threshold=1.0)


def test_a_lone_fast_sample_does_not_make_its_peer_slow():
    # Two healthy ranks probed in turn on one core of a shared host (ms, live): rank 3 drew one
    # sample at the core's fast speed. By each rank's fastest sample, rank 1 read 1.43x rank 3.
    samples = {1: [4.08, 4.17, 4.22, 4.21, 4.11], 3: [4.23, 2.86, 4.21, 4.15, 4.17]}
    assert min(samples[1]) / min(samples[3]) > 1.4
    times = pass_normalised_times(samples)
    assert times[1] / times[3] == pytest.approx(1.0, abs=0.03)


def test_a_slow_rank_reads_its_factor_while_the_host_changes_speed_between_passes():
    samples = {0: [2.0, 2.0, 3.0, 3.0, 3.0], 1: [3.0, 3.0, 4.5, 4.5, 4.5], 2: [2.1, 2.0, 3.1, 2.9, 3.0]}
    times = pass_normalised_times(samples)
    assert times[1] / times[0] == pytest.approx(1.5, rel=0.05)
    assert times[2] / times[0] == pytest.approx(1.0, abs=0.05)
    assert localise(ProbeResults(1, times), 1.2).slow_ranks == (1,)


def test_pass_normalised_times_of_one_subject_and_of_ragged_rounds():
    assert pass_normalised_times({0: [3.0, 1.0, 2.0]}) == {0: 2.0}  # its median sample
    assert pass_normalised_times({0: [1.0, 1.0], 1: [1.0], 2: []}) == {0: 1.0}  # short ones left out
    assert pass_normalised_times({}) == {} and pass_normalised_times({0: []}) == {}


def test_a_round_whose_healthy_probes_disagree_is_undecided_and_one_that_names_or_agrees_is_not():
    # Live rounds, 8 ranks on 2 cores, rank 3 1.5x slow (ms): held-back references put it at
    # 1.19x their median, under the threshold; the rounds before and after named it.
    held_back = {0: 4.62, 1: 5.64, 2: 5.67, 3: 6.72}
    assert localise(ProbeResults(13, held_back), threshold=1.2).slow_ranks == ()
    assert undecided(held_back, 1.2)
    assert not undecided({0: 4.29, 1: 4.56, 2: 4.36, 3: 6.68}, 1.2)  # names rank 3
    assert not undecided({0: 4.44, 1: 5.01, 2: 4.42, 3: 4.38}, 1.2)  # all within 1.2x: healthy
    assert not undecided({0: 4.4}, 1.2)


def _first_suspicion(spec, fault, iterations=60):
    det = FailSlowDetector()
    for iteration, obs in synthetic_trace(spec, iterations, [parse_fault(fault)], seed=5):
        suspicion = det.observe(iteration, obs)
        if suspicion:
            return det, iteration, suspicion
    pytest.fail(f"{fault} was never suspected")


@pytest.mark.parametrize("tp", [1, 2])
def test_suspects_are_compared_with_their_peers_not_a_median_they_sit_in(tp):
    """A whole suspect group 1.35x slow against as many healthy peers: against the median of all
    probes (1.175) it read 1.15x and was cleared at any TP; against its peers it is named."""
    spec = SyntheticSpec(tp_degree=tp, pp_degree=2, dp_degree=2, num_microbatches=4, seq_length=4096)
    det, iteration, suspicion = _first_suspicion(spec, "slow:rank=2,factor=1.35,at=30")
    assert len(suspicion.probe_ranks) == 2 * len(suspicion.ranks)
    times = {r: (0.0135 if r in suspicion.ranks else 0.0100) for r in suspicion.probe_ranks}
    assert localise(ProbeResults(iteration, times), 1.2).slow_ranks == ()
    assert peer_reference_s(times, suspicion.ranks, 1.2) == pytest.approx(0.0100)
    assert undecided(times, 1.2) and not undecided(times, 1.2, suspicion.ranks)
    verdict = det.conclude(suspicion, ProbeResults(iteration, times))
    assert isinstance(verdict, Verdict) and verdict.ranks == tuple(sorted(suspicion.ranks))
    assert verdict.factor == pytest.approx(1.35)


def test_a_slow_rank_among_the_peers_does_not_drag_their_reference():
    # A stage slow in every replica: replica 1's first stage (ranks 2, 3) is suspected, and the
    # peers probed beside it, replica 0's first stage, hold a slow rank too (rank 0, not yet named).
    times = {0: 0.196, 1: 0.069, 2: 0.196, 3: 0.069}
    assert peer_reference_s(times, (2, 3), 1.2) == pytest.approx(0.069)
    loc = localise(ProbeResults(12, times), 1.2, rank_reference_s=peer_reference_s(times, (2, 3), 1.2))
    assert loc.rank_factors[2] == pytest.approx(0.196 / 0.069) and 2 in loc.slow_ranks
    # Peers alike stay one reference, slow or not (a slow peer group clears healthy suspects, below).
    assert peer_reference_s({0: 0.0135, 1: 0.0136, 2: 0.0100}, (2,), 1.2) == pytest.approx(0.01355)


def test_a_slow_peer_clears_the_suspects_rather_than_being_named():
    det, iteration, suspicion = _first_suspicion(SPEC, "slow:rank=2,factor=1.35,at=30")
    times = {r: (0.0100 if r in suspicion.ranks else 0.0135) for r in suspicion.probe_ranks}
    assert isinstance(det.conclude(suspicion, ProbeResults(iteration, times)), Cleared)


def test_localise_compares_each_rank_with_its_own_baseline_when_given_one_for_every_probed_rank():
    probes = ProbeResults(1, {0: 0.0150})
    alone = localise(probes, threshold=1.2)
    assert alone.slow_ranks == () and alone.rank_factors[0] == pytest.approx(1.0)  # its own reference
    own = localise(probes, threshold=1.2, rank_baselines_s={0: 0.0100})
    assert own.slow_ranks == (0,) and own.rank_factors[0] == pytest.approx(1.5)
    assert own.rank_reference_s == pytest.approx(0.0100)
    # Devices of different speeds each against their own: neither is slow.
    both = localise(ProbeResults(1, {0: 0.010, 1: 0.020}), 1.2, rank_baselines_s={0: 0.010, 1: 0.019})
    assert both.slow_ranks == ()
    # A rank without a baseline: the round's median, as without baselines.
    assert localise(ProbeResults(1, {0: 0.010, 1: 0.030}), 1.2, rank_baselines_s={0: 0.010}).slow_ranks == (1,)


ONE_GROUP = SyntheticSpec(tp_degree=1, pp_degree=1, dp_degree=1, num_microbatches=8, seq_length=4096)


def _one_rank_job(baseline_s=None):
    """A one-rank job slowed 1.5x at 40: the detector's verdicts, probes timed as the fault says."""
    fault = parse_fault("slow:rank=0,factor=1.5,at=40")
    det = FailSlowDetector()
    if baseline_s is not None:
        det.set_probe_baselines({0: baseline_s})
    assert det.needs_probe_baselines([(0,)])
    outcomes = []
    for iteration, obs in synthetic_trace(ONE_GROUP, 60, [fault], seed=3):
        suspicion = det.observe(iteration, obs)
        if suspicion is not None:
            assert suspicion.probe_ranks == (0,)  # nobody to probe beside it
            probes = synthetic_probes(ONE_GROUP, [fault], iteration, suspicion.probe_ranks, ())
            outcomes.append(det.conclude(suspicion, probes))
    return outcomes


def test_a_one_rank_job_names_its_slow_device_against_the_devices_own_healthy_probe():
    healthy = synthetic_probes(ONE_GROUP, [], 0, (0,), ()).rank_s[0]
    outcomes = _one_rank_job(baseline_s=healthy)
    verdicts = [o for o in outcomes if isinstance(o, Verdict)]
    assert verdicts and verdicts[0].ranks == (0,) and verdicts[0].factor == pytest.approx(1.5, rel=0.05)
    assert verdicts[0].evidence["probe_reference_s"] == pytest.approx(healthy)
    # Without the baseline the probe is its own reference, and every suspicion is cleared.
    blind = _one_rank_job()
    assert blind and all(isinstance(o, Cleared) for o in blind)


def test_probe_baselines_are_only_needed_without_a_second_stage_group():
    det = FailSlowDetector()
    assert det.needs_probe_baselines([(0, 1)])  # TP2, one stage, one replica
    assert not det.needs_probe_baselines([(0,), (1,)])
