"""What-if CLI: one JSON object with the documented keys; exit code 2 naming a bad flag."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--tp", "2", "--pp", "2", "--dp", "2", "--num-layers", "4", "--hidden-size", "256",
        "--num-attention-heads", "8", "--seq-length", "128", "--global-batch-size", "8"]


def run(*flags):
    return subprocess.run([sys.executable, "-m", "resihp_ext.planner", *BASE, *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_json_output_has_plan_and_comparison():
    proc = run("--slow", "1:0.5", "--dead", "6", "--slow-link", "0:4:0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"plan", "reason", "planning_time_s", "capacity_bound", "predicted_throughput", "baselines"} <= set(out)
    assert {"layout", "quotas", "transfers"} <= set(out["plan"])
    assert sum(out["plan"]["quotas"]) == 8
    assert set(out["baselines"]) == {"no-adaptation", "dp-only", "drop-replica", "checkpoint-restart"}
    assert out["baselines"]["no-adaptation"] == 0.0  # a dead rank stalls the unadapted job
    assert 0 < out["predicted_throughput"] <= out["capacity_bound"] * 1.05


def test_text_output_lists_every_policy():
    proc = run("--slow", "1:0.5")
    assert proc.returncode == 0, proc.stderr
    for name in ("resihp", "no-adaptation", "dp-only", "drop-replica", "checkpoint-restart"):
        assert name in proc.stdout


def test_bad_flags_exit_2_and_name_the_flag():
    for flags, name in ((["--slow", "1"], "--slow"), (["--slow-link", "0:1"], "--slow-link"),
                        (["--dead", "99"], "--dead"), (["--slow", "1:1.5"], "--slow")):
        proc = run(*flags)
        assert proc.returncode == 2 and name in proc.stderr, (flags, proc.stderr)
