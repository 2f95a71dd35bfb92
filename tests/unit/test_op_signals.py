"""The detector's measures: ring-buffer baselines give each id the median (or a quantile) of its
recent values; a link's noise reach learns from readings that did not persist; a TP group's slowest
sibling against the others; how much wall time the ops took per busy second."""

import numpy as np
import pytest

from resihp_ext.detection.link_baselines import LinkBaselines
from resihp_ext.detection.observations import RankObservation
from resihp_ext.detection.op_signals import Baselines, link_gaps, op_tables, sibling_ratios, wall_per_busy


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


def test_adding_many_values_at_once_is_adding_each():
    one, many = Baselines(size=4), Baselines(size=4)
    rng = np.random.default_rng(1)
    for _ in range(12):
        keys = [int(k) for k in rng.choice(40, size=25, replace=False)]  # new ids past the first allocation too
        values = rng.random(25).tolist()
        for key, value in zip(keys, values):
            one.add(key, value)
        many.add_many(keys, values)
    many.add_many([], [])
    assert one.index == many.index
    np.testing.assert_array_equal(one.count, many.count)
    np.testing.assert_array_equal(one.values, many.values)
    assert one.medians(min_count=1) == many.medians(min_count=1)


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


def test_medians_of_rows_at_every_fill_level_are_each_rows_own():
    # Rows fill together in a job (every link reports each iteration) and are taken one call per
    # fill level; rows with fewer than min_count values have no median yet.
    rng = np.random.default_rng(0)
    baselines, recent = Baselines(8), {}
    for key, count in {"a": 2, "b": 3, "c": 3, "d": 5, "e": 8, "f": 11, "g": 5}.items():
        values = rng.uniform(0.5, 2.0, count).tolist()
        for v in values:
            baselines.add(key, v)
        recent[key] = values[-8:]
    medians = baselines.medians(min_count=3)
    assert medians.keys() == recent.keys() - {"a"}
    for key, value in medians.items():
        assert value == pytest.approx(float(np.median(recent[key]))), key


def test_a_groups_slowest_sibling_is_judged_against_the_median_of_the_others():
    ratios = sibling_ratios({(0, 0): [1.0, 1.1, 3.0, 0.9], (0, 1): [2.0], (1, 0): [0.0, 0.5]})
    assert ratios.keys() == {(0, 0)}  # one sibling has no reference; idle others give no ratio
    assert ratios[(0, 0)] == pytest.approx(3.0 / 1.0)  # the median of 0.9, 1.0, 1.1


def test_wall_per_busy_is_one_on_a_device_of_its_own_and_grows_when_ranks_share_one():
    def observation(rank, stretch):
        ops = (("F", 0, 0.0, 2.0 * stretch), ("B", 0, 2.0 * stretch, 6.0 * stretch))
        return RankObservation(rank=rank, replica=0, stage=rank, tp_rank=0, ops=ops, features=((8, 64, 1),),
                               iteration_s=6.0 * stretch, busy=(2.0, 4.0))
    own = op_tables([observation(r, 1.0) for r in range(2)])
    shared = op_tables([observation(0, 1.0), observation(1, 3.0)])
    assert wall_per_busy(own) == pytest.approx(1.0)
    assert wall_per_busy(shared) == pytest.approx((6.0 + 18.0) / 12.0)


def _ranks(replica: int, stage: int, f_starts, f_ends, b_starts, b_ends) -> RankObservation:
    ops = [*(("F", mb, s, e) for mb, (s, e) in enumerate(zip(f_starts, f_ends))),
           *(("B", mb, s, e) for mb, (s, e) in enumerate(zip(b_starts, b_ends)))]
    return RankObservation(rank=10 * replica + stage, replica=replica, stage=stage, tp_rank=0, ops=tuple(ops),
                           features=tuple((64, 4096, 1) for _ in f_starts), iteration_s=10.0,
                           busy=tuple(e - s for _, _, s, e in ops))


def test_op_tables_pad_replicas_that_run_fewer_micro_batches_and_link_gaps_ignore_the_padding():
    # Replica 0 runs three micro-batches, replica 1 two (a re-plan gave it a smaller quota); each
    # has two stages, whose link gaps are the next stage's start less this stage's end.
    observations = [
        _ranks(0, 0, [0, 1, 2], [1, 2, 3], [7, 8, 9], [7.5, 8.5, 9.5]),
        _ranks(0, 1, [1.2, 2.1, 3.3], [2, 3, 4], [6.8, 7.6, 8.9], [7, 8, 9]),
        _ranks(1, 0, [0, 1], [1, 2], [5, 6], [5.5, 6.5]),
        _ranks(1, 1, [1.5, 2.5], [2, 3], [4.6, 5.9], [5, 6]),
    ]
    tables = op_tables(observations)
    assert tables.shape == (4, 6, 3)
    assert np.isnan(tables[2:, :, 2]).all() and not np.isnan(tables[:2]).any()
    np.testing.assert_array_equal(tables[3, :, :2], op_tables(observations[3:])[0])  # its own, unpadded
    np.testing.assert_allclose(tables[1, 4], [0.8, 0.9, 0.7])  # busy: each forward's end - start
    groups = {(o.replica, o.stage): [o] for o in observations}
    gaps = link_gaps(groups, tables, {o.rank: i for i, o in enumerate(observations)})
    assert gaps.keys() == {(0, 1), (1, 0), (10, 11), (11, 10)}
    assert gaps[(0, 1)] == (pytest.approx(0.1), 3)  # activations: 1.2 - 1, 2.1 - 2, 3.3 - 3
    assert gaps[(1, 0)] == (pytest.approx(0.0), 3)  # gradients: 7 - 7, 8 - 8, 9 - 9
    assert gaps[(10, 11)] == (pytest.approx(0.5), 2)  # 1.5 - 1, 2.5 - 2: the padding adds no transfer
    assert gaps[(11, 10)] == (pytest.approx(0.0), 2)
    assert link_gaps({(0, 0): observations[:1]}, tables[:1], {0: 0}) == {}  # one stage: no links


def test_a_transfer_that_overlaps_reads_as_a_gap_of_zero():
    sender = _ranks(0, 0, [0], [2], [5], [6])
    receiver = _ranks(0, 1, [1], [3], [3], [4])  # starts before the sender ends (clocks a hair apart)
    tables = op_tables([sender, receiver])
    gaps = link_gaps({(0, 0): [sender], (0, 1): [receiver]}, tables, {0: 0, 1: 1})
    assert gaps == {(0, 1): (0.0, 1), (1, 0): (1.0, 1)}
