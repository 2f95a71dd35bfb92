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

STEP_COST = 0.02  # what detection adds to the iteration that detects (the detection step)
NEXT_COST = 0.03  # and to the next one (rank 0 judged before starting it; the others wait for it)


def _write_runs(tmp_path, decision_cpu_s=0.0, iterations=400, seed=3, phases=live_detection.ALTERNATE_PHASES,
                step_cost=STEP_COST, next_cost=NEXT_COST, probe_round_s=0.0):
    """Two runs of the same data (iteration costs that swing 2x), on a host whose speed drifts
    differently in each run, each detecting on every 4th iteration, half a period apart. With
    ``probe_round_s``, the 1st, 2nd, 4th, ..., 32nd detection steps of each run also take a probe
    round that long, as a one-stage-group job's own probe baselines do."""
    rng = random.Random(seed)
    data = [rng.uniform(0.25, 0.5) for _ in range(iterations + 1)]
    logs = []
    for run, phase in enumerate(phases):
        period, offset = (int(v) for v in phase.split(":"))
        drift_phase = rng.uniform(0, 2 * math.pi)
        rows, detections = [], 0
        for i in range(1, iterations + 1):
            detecting = i % period == offset
            after = (i - 1) % period == offset
            detections += detecting
            probes = int(detecting and probe_round_s > 0 and detections in (1, 2, 4, 8, 16, 32))
            host = 1 + 0.08 * math.sin(i / 15 + drift_phase) + rng.gauss(0, 0.005)
            elapsed = data[i] * host * (1 + (next_cost if after else 0.0))
            step = elapsed + (data[i] * host * step_cost if detecting else 0.0) + probes * probe_round_s
            rows.append({"event": "iteration", "iteration": i, "detecting": detecting, "step_s": step,
                         "elapsed_s": elapsed, "probe_rounds": probes})
        rows.append({"event": "detector_overhead", "iteration": -1, "decision_s": 0.0,
                     "decision_cpu_s": decision_cpu_s})
        log = tmp_path / f"run{run}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        logs.append(log)
    return logs


def test_the_estimate_counts_what_detection_carries_into_the_next_iteration(tmp_path):
    # A job detecting after every iteration pays both parts in every iteration: 5%.
    result = live_detection.paired_overhead(_write_runs(tmp_path), skip=10)
    low, high = result["ci95_pct"]
    assert low <= 100 * (STEP_COST + NEXT_COST) <= high, result
    assert high - low < 1.0, result  # the neighbours take the drift out
    cross_low, cross_high = result["cross_run_ci95_pct"]
    assert cross_high - cross_low > 2 * (high - low), result  # across runs the drift stays in
    assert result["after_step_pct"] == pytest.approx(100 * STEP_COST, rel=0.1)  # the step alone, directly


def test_a_cost_that_lands_only_on_the_next_iteration_is_counted_in_full(tmp_path):
    # What comparing each iteration with its neighbours, detecting on every other one, got wrong:
    # the next iteration was the baseline, so this cost read as a saving.
    result = live_detection.paired_overhead(_write_runs(tmp_path, step_cost=0.0, next_cost=0.04), skip=10)
    low, high = result["ci95_pct"]
    assert low <= 4.0 <= high and low > 3.0, result


def test_probe_rounds_are_counted_apart_from_the_cost_of_every_detection(tmp_path):
    # Baseline rounds of 0.2 s (about half an iteration) after detections 1, 2, 4, ..., 32 of 100:
    # counted in, they would be most of the estimate; they stop after the 32nd detection.
    result = live_detection.paired_overhead(_write_runs(tmp_path, probe_round_s=0.2), skip=10)
    low, high = result["ci95_pct"]
    assert low <= 100 * (STEP_COST + NEXT_COST) <= high, result
    assert result["after_step_pct"] == pytest.approx(100 * STEP_COST, rel=0.1)
    assert result["probe_rounds"] == [6, 6]
    assert result["probe_round_ms"] == pytest.approx(200, rel=0.05)
    assert result["overhead_pct_with_probes"] > high, result
    without = live_detection.paired_overhead(_write_runs(tmp_path), skip=10)
    assert without["probe_rounds"] == [0, 0] and without["probe_round_ms"] is None


def test_the_cost_is_split_between_the_detecting_iteration_the_next_and_the_detection_step(tmp_path):
    result = live_detection.paired_overhead(_write_runs(tmp_path, step_cost=0.01, next_cost=0.03), skip=10)
    assert result["next_iteration_pct"] == pytest.approx(3.0, abs=0.5), result
    assert result["detecting_iteration_pct"] == pytest.approx(0.0, abs=0.5), result
    assert result["after_step_pct"] == pytest.approx(1.0, rel=0.1), result
    assert "host_busy_pct" not in result  # the events carry no host times


def test_host_time_and_collector_pauses_are_read_from_the_events(tmp_path):
    logs = _write_runs(tmp_path)
    for log in logs:
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        for row in rows:
            if row["event"] == "iteration":
                # a host busy 90% of each iteration, a 2 ms pause every 10th, one full collection
                row.update(cpu_s=0.9 * row["step_s"], gc_s=0.002 * (row["iteration"] % 10 == 0),
                           gc_full=int(row["iteration"] == 50))
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = live_detection.paired_overhead(logs, skip=10)
    assert result["host_busy_pct"] == pytest.approx(90.0)
    assert result["gc_ms_per_iteration"] == pytest.approx(0.2)
    assert result["gc_full"] == 2


def test_rank_0s_judging_is_reported_as_cpu_per_detecting_iteration(tmp_path):
    # 100 detecting iterations per run, each judged in 3.75 ms of rank 0's CPU.
    result = live_detection.paired_overhead(_write_runs(tmp_path, decision_cpu_s=0.375), skip=10)
    assert result["decider_cpu_pct"] == pytest.approx(100 * 0.75 / 200 / result["median_step_s_off"], abs=1e-3)


def test_runs_of_other_phases_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="are not runs of RESIHP_ALTERNATE_DETECTION 4:0 and 4:2"):
        live_detection.paired_overhead(_write_runs(tmp_path, phases=("2:1", "2:0")), skip=10)


def test_pairs_of_runs_that_disagree_widen_the_pooled_interval(tmp_path):
    # Two pairs of runs whose detection really cost 2% and 6%: each pair's own interval is narrow
    # and excludes the other's cost; pooled, the estimate lies between and the interval, which now
    # counts the pairs' disagreement, holds both.
    pairs = []
    for k, cost in enumerate((0.02, 0.06)):
        folder = tmp_path / f"pair{k}"
        folder.mkdir()
        pairs.append(live_detection.paired_overhead(
            _write_runs(folder, step_cost=cost, next_cost=0.0, seed=5 + k), skip=10))
    low0, high0 = pairs[0]["ci95_pct"]
    low1, high1 = pairs[1]["ci95_pct"]
    assert high0 < 6.0 and low1 > 2.0, pairs
    pooled = live_detection.pooled_overhead(pairs)
    assert pooled["pairs"] == 2 and pooled["detections_paired"] == sum(p["detections_paired"] for p in pairs)
    assert 2.0 < pooled["overhead_pct"] < 6.0
    low, high = pooled["ci95_pct"]
    assert low < 2.0 and high > 6.0, pooled
    assert pooled["between_pairs_half_pct"] > pooled["within_pairs_half_pct"]
    # Pairs that agree keep about their within-pair interval.
    agreeing = live_detection.pooled_overhead([pairs[0], pairs[0]])
    assert agreeing["overhead_pct"] == pytest.approx(pairs[0]["overhead_pct"], abs=1e-3)
    assert agreeing["between_pairs_half_pct"] == 0.0
    assert agreeing["ci95_pct"][1] - agreeing["ci95_pct"][0] < high0 - low0
