"""The dead verdict on a host that runs late: late beats widen the deadline, a death does not."""

import pytest

from resihp_ext.detection.host_lateness import HostLateness, judge_heartbeats_under_load


def test_on_time_beats_allow_nothing():
    late = HostLateness(interval_s=0.2, window_s=30.0, cap_s=6.0)
    for i in range(10):
        late.beats(i * 0.25, {0: i * 0.25, 1: i * 0.25 + 0.01})  # 0.05 s of jitter per beat
        late.poll(i * 0.25, 0.0)
    assert late.allowance(2.5) == pytest.approx(0.05)


def test_a_late_beat_is_allowed_for_the_window_then_forgotten():
    late = HostLateness(interval_s=0.2, window_s=30.0, cap_s=6.0)
    late.beats(10.0, {0: 10.0, 1: 10.0})
    late.beats(12.6, {0: 12.5, 1: 10.2})  # rank 0's beacon was held back 2.3 s
    assert late.allowance(12.6) == pytest.approx(2.3)
    late.beats(13.0, {0: 12.7, 1: 12.9})  # rank 1 caught up: 2.5 s late; the largest counts
    assert late.allowance(13.0) == pytest.approx(2.5)
    assert late.allowance(42.9) == pytest.approx(2.5)
    assert late.allowance(43.1) == 0.0


def test_the_watchers_own_lateness_counts_and_the_cap_holds():
    late = HostLateness(interval_s=0.2, window_s=30.0, cap_s=6.0)
    late.poll(5.0, 1.2)
    assert late.allowance(5.0) == pytest.approx(1.2)
    late.poll(6.0, 20.0)  # stopped for a long time: still at most the cap
    assert late.allowance(6.0) == 6.0


def test_a_dead_beacon_adds_no_lateness():
    # A rank lost with its beacon sends no next beat: the same beat read again counts nothing.
    late = HostLateness(interval_s=0.2, window_s=30.0, cap_s=6.0)
    for i in range(13):
        now = 10.0 + 0.25 * i
        late.beats(now, {0: now, 1: 10.0})
        late.poll(now, 0.0)
    assert late.allowance(13.0) == pytest.approx(0.05)
    assert judge_heartbeats_under_load(13.0, {1: 10.0}, 1.5, late.allowance(13.0), freshest_beat=13.0) == {1}


def test_a_new_generations_older_beat_counts_nothing():
    late = HostLateness(interval_s=0.2, window_s=30.0, cap_s=6.0)
    late.beats(10.0, {0: 10.0})
    late.beats(10.5, {0: 9.0})
    late.beats(10.7, {0: 9.2})
    assert late.allowance(10.7) == 0.0


def test_judge_allows_the_lateness_and_names_nobody_when_every_beat_is_stale():
    last = {1: 10.0, 2: 11.9}
    assert judge_heartbeats_under_load(12.0, last, 1.5) == {1}
    assert judge_heartbeats_under_load(12.0, last, 1.5, allowance_s=1.0) == frozenset()
    assert judge_heartbeats_under_load(12.6, last, 1.5, allowance_s=1.0) == {1}
    # Every beat read, this rank's own included, is older than the deadline: the host or the
    # store stood still; nobody is named.
    assert judge_heartbeats_under_load(14.0, last, 1.5, freshest_beat=11.9) == frozenset()
    assert judge_heartbeats_under_load(14.0, last, 1.5, freshest_beat=13.9) == {1, 2}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        judge_heartbeats_under_load(1.0, {}, 0.0)
    with pytest.raises(ValueError):
        judge_heartbeats_under_load(1.0, {}, 1.5, allowance_s=-1.0)
    with pytest.raises(ValueError):
        HostLateness(interval_s=0.0, window_s=30.0, cap_s=6.0)

