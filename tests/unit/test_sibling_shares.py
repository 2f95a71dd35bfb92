"""SiblingShares: a standing offset between TP siblings is learnt from healthy iterations only, and
only so far."""

import pytest

from resihp_ext.detection.sibling_shares import MAX_OFFSET, MIN_SAMPLES, SiblingShares

G = (0, 0)


def test_until_learnt_siblings_are_judged_on_their_raw_busy_times():
    shares = SiblingShares(history=8)
    shares.learn({G: {0: 1.0, 1: 0.9}}, [G])  # fewer than MIN_SAMPLES
    assert shares.ratios({G: {0: 1.0, 1: 1.3}})[G] == pytest.approx(1.3)


def test_a_learnt_offset_is_divided_out():
    shares = SiblingShares(history=8)
    for _ in range(MIN_SAMPLES):
        shares.learn({G: {0: 1.0, 1: 0.9}}, [G])
    assert shares.ratios({G: {0: 1.0, 1: 0.9}})[G] == pytest.approx(1.0)
    # The lighter sibling 1.5x slow reads 1.35 raw, 1.5 over its share.
    assert shares.ratios({G: {0: 1.0, 1: 1.35}})[G] == pytest.approx(1.5)


def test_only_healthy_groups_teach_and_an_offset_is_learnt_only_so_far():
    shares = SiblingShares(history=8)
    for _ in range(MIN_SAMPLES):
        shares.learn({G: {0: 1.0, 1: 3.0}}, [])  # suspect: teaches nothing
    assert shares.share((0, 1), 1) == 1.0
    for _ in range(MIN_SAMPLES):
        shares.learn({G: {0: 1.0, 1: 3.0}}, [G])
    assert shares.share((0, 1), 1) == pytest.approx(1.0 + MAX_OFFSET)
    assert shares.share((0, 1), 0) == pytest.approx(1.0 - MAX_OFFSET)


def test_a_rank_regrouped_learns_its_share_among_its_new_siblings():
    shares = SiblingShares(history=8)
    for _ in range(MIN_SAMPLES):
        shares.learn({G: {0: 1.0, 1: 0.9}}, [G])
    assert shares.share((0, 1), 1) != 1.0
    assert shares.share((1, 2), 1) == 1.0
