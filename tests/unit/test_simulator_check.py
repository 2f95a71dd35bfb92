"""scripts/bench/simulator_check.py: each re-plan's predicted iteration time beside the medians measured
before and after it in the same run, on hand-made event logs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench" / "simulator_check.py"
_SPEC = importlib.util.spec_from_file_location("simulator_check", SCRIPT)
simulator_check = importlib.util.module_from_spec(_SPEC)
sys.modules["simulator_check"] = simulator_check  # dataclasses look their module up there
_SPEC.loader.exec_module(simulator_check)


def _log(elapsed: dict[int, float], others: list[dict]) -> list[dict]:
    rows = [{"event": "iteration", "iteration": i, "time": 100.0 + i, "rank": 7, "elapsed_s": s}
            for i, s in elapsed.items()]
    return rows + [{"time": 100.0 + r["iteration"] + 0.5, "rank": 0, **r} for r in others]


def _slow_then_recovered() -> list[dict]:
    """Rank 7 slow from 5 until 13; re-planned at 7 and, once fast, at 15. Healthy 2.0 s; slow 4.0 s
    with the first slow iteration 4.4 (left out: it follows a change); 2.5 s on the skewed plan,
    whose first iteration 3.0 pays for the rebuild (left out); 2.2 s once the rank is fast again."""
    elapsed = {i: 2.0 for i in range(1, 5)}
    elapsed.update({5: 4.4, 6: 4.0, 7: 4.2, 8: 3.0, 9: 2.5, 10: 2.5, 11: 2.6, 12: 2.5, 13: 2.3, 14: 2.2, 15: 2.2})
    elapsed.update({16: 2.9, 17: 2.0, 18: 2.1, 19: 2.0})
    return _log(elapsed, [
        {"event": "inject", "iteration": 5, "fault": "slow:rank=7,factor=2,at=5,until=13"},
        {"event": "verdict", "iteration": 5, "kind": "compute", "ranks": [7], "factor": 1.98},
        {"event": "plan", "iteration": 7, "action": "adapt", "policy": "resihp",
         "predicted_iteration_s_before": 4.2, "predicted_iteration_s_after": 2.25},
        {"event": "adapted", "iteration": 7, "quotas": [9, 7]},
        {"event": "inject_end", "iteration": 13, "fault": "slow:rank=7,factor=2,at=5,until=13"},
        {"event": "plan", "iteration": 15, "action": "adapt", "policy": "resihp",
         "predicted_iteration_s_before": 2.2, "predicted_iteration_s_after": 1.92},
    ])


def test_predictions_are_set_beside_the_medians_measured_since_the_last_change_and_until_the_next():
    first, second = simulator_check.compare(_slow_then_recovered())
    # Before the first re-plan: iterations 6-7 (5 follows the fault's onset); after: 9-12 (8 is the
    # rebuilt layout's first; 13 is where the fault ends).
    assert first.before_window == (6, 7) and first.measured_before_s == pytest.approx(4.1)
    assert first.after_window == (9, 12) and first.measured_after_s == pytest.approx(2.5)
    assert first.error_before == pytest.approx(4.2 / 4.1 - 1)
    assert first.error_after == pytest.approx(2.25 / 2.5 - 1)
    # The second re-plan: 14-15 before it, 17 to the end after it.
    assert second.before_window == (14, 15) and second.measured_before_s == pytest.approx(2.2)
    assert second.after_window == (17, 19) and second.measured_after_s == pytest.approx(2.0)
    assert second.error_after == pytest.approx(1.92 / 2.0 - 1)
    assert first.to_dict()["error_after"] == pytest.approx(-0.1)
    assert first.unpredicted_s == pytest.approx((4.1 - 4.2, 2.5 - 2.25))


def test_a_fail_stop_plan_is_read_from_executed_and_a_stalled_before_has_no_error():
    records = _log({1: 2.0, 2: 2.0, 3: 2.0, 4: 3.1, 5: 2.4, 6: 2.4, 7: 2.6}, [
        {"event": "inject", "iteration": 3, "fault": "kill:rank=5,at=3"},
        {"event": "plan", "iteration": 3, "action": "adapt",
         "executed": {"iteration_s_before": None, "iteration_s_after": 2.5}},
        {"event": "plan", "iteration": 4, "action": "keep", "reason": "nothing to predict"},
    ])
    [row] = simulator_check.compare(records)
    assert row.predicted_before_s is None and row.error_before is None
    assert row.after_window == (5, 7) and row.measured_after_s == pytest.approx(2.4)
    assert row.error_after == pytest.approx(2.5 / 2.4 - 1)


def test_a_redone_iteration_counts_its_last_run():
    records = _log({1: 2.0, 2: 2.0, 3: 2.0}, [
        {"event": "plan", "iteration": 1, "action": "adapt", "predicted_iteration_s_before": 2.0,
         "predicted_iteration_s_after": 1.0},
    ])
    records.append({"event": "iteration", "iteration": 3, "time": 200.0, "rank": 3, "elapsed_s": 1.0})
    [row] = simulator_check.compare(records)
    assert row.after_window == (3, 3) and row.measured_after_s == 1.0 and row.error_after == 0.0


def test_the_script_reports_a_log_and_refuses_logs_it_cannot_use(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _slow_then_recovered()))
    done = subprocess.run([sys.executable, str(SCRIPT), "--events", str(log), "--json"],
                          capture_output=True, text=True, check=True)
    plans = json.loads(done.stdout)["plans"]
    assert [p["plan_iteration"] for p in plans] == [7, 15] and plans[0]["error_after"] == pytest.approx(-0.1)
    text = subprocess.run([sys.executable, str(SCRIPT), "--events", str(log)], capture_output=True, text=True,
                          check=True).stdout
    assert "largest |error| 10.0%; goal 5%: not met (3 of 4 within)" in text, text
    for content, expected in ((None, "cannot read"), ("not json\n", "not JSONL"),
                              (json.dumps({"event": "iteration", "iteration": 1, "time": 1.0, "rank": 0,
                                           "elapsed_s": 1.0}) + "\n", "no plan event"),
                              (json.dumps({"event": "iteration", "iteration": 1}) + "\n", "malformed field")):
        bad = tmp_path / "bad.jsonl"
        bad.unlink(missing_ok=True)
        if content is not None:
            bad.write_text(content)
        refused = subprocess.run([sys.executable, str(SCRIPT), "--events", str(bad)], capture_output=True, text=True)
        assert refused.returncode == 2 and expected in refused.stderr and not refused.stdout, refused.stderr
