"""What detection costs is measured on alternate iterations (``megatron/resihp/detection_cost.py``)."""

import gc

import pytest

from megatron.resihp.detection_cost import VARIABLE, PauseClock, period_and_phase


def test_the_pause_clock_counts_collections_and_their_time_until_stopped():
    clock = PauseClock()
    try:
        assert clock.read() == (0.0, 0)
        gc.collect()
        gc.collect(0)
        paused_s, full = clock.read()
        assert paused_s > 0 and full == 1
    finally:
        clock.stop()
    gc.collect()
    assert clock.read() == (paused_s, full)
    clock.stop()  # twice is harmless


def test_the_period_and_phase_come_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert period_and_phase() is None
    monkeypatch.setenv(VARIABLE, "4:2")
    assert period_and_phase() == (4, 2)
    for bad in ("4:4", "4", "a:1", "0:0"):
        monkeypatch.setenv(VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{VARIABLE} must be PERIOD:PHASE"):
            period_and_phase()
