"""What detection costs, estimated from two alternate-detection runs (scripts/bench/live_detection.py)."""

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "live_detection", Path(__file__).resolve().parents[2] / "scripts" / "bench" / "live_detection.py")
live_detection = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(live_detection)

COST = 0.05  # what detection adds to an iteration that detects


def _write_runs(tmp_path, decision_cpu_s=0.0, iterations=200, seed=3):
    """Two runs of the same data (iteration costs that swing 2x), on a host whose speed drifts
    differently in each run, with detection on the odd iterations of one and the even of the other."""
    rng = random.Random(seed)
    data = [rng.uniform(0.25, 0.5) for _ in range(iterations + 1)]
    logs = []
    for run, parity in enumerate((1, 0)):
        drift_phase = rng.uniform(0, 2 * math.pi)
        rows = []
        for i in range(1, iterations + 1):
            detecting = i % 2 == parity
            host = 1 + 0.08 * math.sin(i / 15 + drift_phase) + rng.gauss(0, 0.005)
            step = data[i] * host * (1 + COST if detecting else 1)
            rows.append({"event": "iteration", "iteration": i, "detecting": detecting, "step_s": step,
                         "elapsed_s": step * (0.99 if detecting else 1.0)})
        rows.append({"event": "detector_overhead", "iteration": -1, "decision_s": 0.0,
                     "decision_cpu_s": decision_cpu_s})
        log = tmp_path / f"run{run}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        logs.append(log)
    return logs


def test_the_within_run_estimate_finds_the_cost_through_a_drifting_host(tmp_path):
    result = live_detection.paired_overhead(_write_runs(tmp_path), skip=10)
    low, high = result["ci95_pct"]
    assert low <= 100 * COST <= high, result
    assert high - low < 1.0, result  # the neighbours take the drift out
    cross_low, cross_high = result["cross_run_ci95_pct"]
    assert cross_high - cross_low > 2 * (high - low), result  # across runs the drift stays in


def test_rank_0s_judging_is_reported_as_cpu_per_detecting_iteration(tmp_path):
    # 100 detecting iterations per run, each judged in 3.75 ms of rank 0's CPU.
    result = live_detection.paired_overhead(_write_runs(tmp_path, decision_cpu_s=0.375), skip=10)
    assert result["decider_cpu_pct"] == pytest.approx(100 * 0.75 / 200 / result["median_step_s_off"], abs=1e-3)
