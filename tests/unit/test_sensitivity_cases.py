"""The slowdowns scripts/bench/detection.py --sensitivity replays: steps, ramps and bursts of one rank."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "detection_bench", Path(__file__).resolve().parents[2] / "scripts" / "bench" / "detection.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _factor(faults, iteration: int) -> float:
    return max((f.factor for f in faults if f.active(iteration)), default=1.0)


def test_a_ramp_grows_evenly_to_its_top_and_stays_there():
    ramp = bench._ramp(rank=37, top=1.5, at=40, over=10)
    assert {f.rank for f in ramp} == {37}
    assert _factor(ramp, 39) == 1.0
    assert [_factor(ramp, i) for i in range(40, 50)] == pytest.approx([1.0 + 0.05 * k for k in range(1, 11)])
    assert all(_factor(ramp, i) == 1.5 for i in range(50, 300))


def test_every_case_slows_rank_37_from_the_onset():
    cases = bench.sensitivity_cases()
    assert {"step 1.5x", "ramp to 1.5x over 60", "bursts 1.5x 3 on 3 off"} <= set(cases)
    for name, faults in cases.items():
        assert {f.rank for f in faults} == {37}, name
        assert _factor(faults, bench.ONSET - 1) == 1.0 and _factor(faults, bench.ONSET) > 1.0, name
    bursts = cases["bursts 1.5x 3 on 3 off"]
    assert [_factor(bursts, i) for i in range(40, 52)] == [1.5] * 3 + [1.0] * 3 + [1.5] * 3 + [1.0] * 3
