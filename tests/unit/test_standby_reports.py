"""A standby's reported slowdown: one disturbed probe does not hide a healthy device, a slow one
shows within the reported probes."""

from __future__ import annotations

import pytest

from resihp_ext.detection.standby_reports import REPORTED_PROBES, StandbySlowdown

THRESHOLD = 1.2  # --resihp-probe-threshold's default


def test_a_healthy_standby_with_one_disturbed_probe_still_reports_healthy():
    slowdown = StandbySlowdown()
    reports = [slowdown.add(f) for f in (1.02, 1.45, 0.98, 1.31, 1.60, 1.01)]
    assert all(r < THRESHOLD for r in reports), reports


def test_a_standby_that_turns_slow_reports_it_after_its_reported_probes():
    slowdown = StandbySlowdown()
    slowdown.add(1.0)
    reports = [slowdown.add(16.0) for _ in range(REPORTED_PROBES)]
    assert reports[-2] < THRESHOLD <= reports[-1] == 16.0, reports


def test_a_standby_whose_slowdown_ends_reports_healthy_at_its_first_healthy_probe():
    slowdown = StandbySlowdown()
    for _ in range(5):
        slowdown.add(16.0)
    assert slowdown.add(1.03) == 1.03


def test_nothing_is_reported_before_a_probe():
    with pytest.raises(ValueError, match="no probe"):
        StandbySlowdown().reported
    with pytest.raises(ValueError, match="at least one probe"):
        StandbySlowdown(0)
