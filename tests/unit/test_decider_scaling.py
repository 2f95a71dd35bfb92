"""scripts/bench/decider_scaling.py: rank 0's judging timed at a job size, and its flags checked."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("decider_scaling", REPO / "scripts" / "bench" / "decider_scaling.py")
decider_scaling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(decider_scaling)


def test_a_healthy_job_is_judged_without_suspicion_and_timed_per_rank():
    row = decider_scaling.measure(64, iters=5)
    assert row["ranks"] == 64 and row["suspicions"] == 0
    assert row["ms_per_iteration"] > 0 and row["iteration_s"] > 0
    assert abs(row["us_per_rank"] - 1e3 * row["ms_per_iteration"] / 64) < 0.1
    assert abs(row["pct_of_iteration"] - 100 * row["ms_per_iteration"] / 1e3 / row["iteration_s"]) < 0.05


def test_the_script_prints_one_row_per_size_and_refuses_sizes_it_cannot_lay_out():
    script = str(REPO / "scripts" / "bench" / "decider_scaling.py")
    ok = subprocess.run([sys.executable, script, "--json", "--ranks", "32,64", "--iters", "5"],
                        capture_output=True, text=True, check=True)
    rows = json.loads(ok.stdout)["rows"]
    assert [r["ranks"] for r in rows] == [32, 64] and rows[0]["per_rank_over_smallest"] == 1.0
    bad = subprocess.run([sys.executable, script, "--ranks", "48"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--ranks" in bad.stderr and "multiple of 32" in bad.stderr, bad.stderr
