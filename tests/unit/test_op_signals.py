"""The detector's measures: ring-buffer baselines give each id the median (or a quantile) of its
recent values; a link's noise reach learns from readings that did not persist; a TP group's slowest
sibling against the others; how much wall time the ops took per busy second."""

import numpy as np
import pytest

from resihp_ext.link_baselines import LinkBaselines
from resihp_ext.observations import RankObservation
from resihp_ext.op_signals import Baselines, op_times, sibling_ratios, wall_per_busy


def test_baseline_medians_and_quantiles_are_over_each_ids_last_values():
    baselines, history = Baselines(size=5), {}
    rng = np.random.default_rng(0)
    for _ in range(40):
        for key in range(20):  # more ids than the first allocation holds, filling at different rates
            if rng.random() < 0.5:
                value = float(rng.random())
                baselines.add(key, value)
                history.setdefault(key, []).append(value)
        expected = {k: float(np.median(v[-5:])) for k, v in history.items() if len(v) >= 3}
        got = baselines.medians(min_count=3)
        assert got.keys() == expected.keys()
        assert all(abs(got[k] - expected[k]) < 1e-12 for k in got)
        for k, v in history.items():
            assert baselines.quantile(k, 0.95) == pytest.approx(float(np.quantile(v[-5:], 0.95)))
    assert np.isnan(baselines.quantile("never seen", 0.95))
    assert Baselines(size=4).medians(min_count=1) == {}


def _judge(links, gap_s, threshold=1.25):
    gaps = {(0, 2): (gap_s, 4)}
    ratios = links.ratios(gaps, min_excess_s=0.005)
    links.learn(gaps, ratios, threshold, muted=())
    return ratios.get((0, 2))


def test_a_link_reading_that_did_not_persist_raises_its_noise_reach_and_a_persistent_one_does_not():
    links = LinkBaselines(size=32)
    for _ in range(20):
        assert _judge(links, 0.0005) in (None, 1.0)
    for _ in range(2):  # 3.5 ms over 4 transfers: slow, and not repeated the next iteration
        assert _judge(links, 0.004) == pytest.approx(8.0)
        assert _judge(links, 0.0005) == 1.0
    # Seen twice in 24 non-persistent readings: within the link's noise reach now.
    assert _judge(links, 0.004) == 1.0
    # Further out than the noise has reached is slow, and stays slow: a persistent slowdown is
    # never learnt as noise.
    assert [_judge(links, 0.02) for _ in range(40)] == [pytest.approx(40.0)] * 40
    # A muted link (a known slowdown) learns nothing.
    muted = LinkBaselines(size=32)
    for _ in range(5):
        muted.learn({(0, 2): (0.0005, 4)}, {}, 1.25, muted={(0, 2)})
    assert muted.ratios({(0, 2): (0.0005, 4)}, 0.005) == {}


def test_a_forgotten_link_learns_its_current_speed_as_the_norm():
    links = LinkBaselines(size=32)
    for _ in range(20):
        _judge(links, 0.0005)
    assert _judge(links, 0.004) == pytest.approx(8.0)
    links.forget((0, 2))
    # Its next min_count readings are its norm, slow as they are; then only a further change shows.
    assert [_judge(links, 0.004) for _ in range(3)] == [None] * 3
    assert _judge(links, 0.004) == 1.0
    assert _judge(links, 0.04) == pytest.approx(10.0)
    assert links.forget(("never", "seen")) is None  # nothing to forget: no error


def test_a_groups_slowest_sibling_is_judged_against_the_median_of_the_others():
    ratios = sibling_ratios({(0, 0): [1.0, 1.1, 3.0, 0.9], (0, 1): [2.0], (1, 0): [0.0, 0.5]})
    assert ratios.keys() == {(0, 0)}  # one sibling has no reference; idle others give no ratio
    assert ratios[(0, 0)] == pytest.approx(3.0 / 1.0)  # the median of 0.9, 1.0, 1.1


def test_wall_per_busy_is_one_on_a_device_of_its_own_and_grows_when_ranks_share_one():
    def observation(rank, stretch):
        ops = (("F", 0, 0.0, 2.0 * stretch), ("B", 0, 2.0 * stretch, 6.0 * stretch))
        return RankObservation(rank=rank, replica=0, stage=rank, tp_rank=0, ops=ops, features=((8, 64, 1),),
                               iteration_s=6.0 * stretch, busy=(2.0, 4.0))
    own = {r: op_times(observation(r, 1.0)) for r in range(2)}
    shared = {0: op_times(observation(0, 1.0)), 1: op_times(observation(1, 3.0))}
    assert wall_per_busy(own) == pytest.approx(1.0)
    assert wall_per_busy(shared) == pytest.approx((6.0 + 18.0) / 12.0)
