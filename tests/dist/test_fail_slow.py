"""Fail-slow handled in place: detected, planned and applied inside the same processes.

Throughput gains are measured by scripts/bench/adaptation.py; this test checks the behaviour:
the verdict names the slowed rank, a plan is applied without a restart, and training stays exact
(losses equal a failure-free run's whatever the plan moved or rebalanced).
"""

import pytest

from tests.dist.launch import check, iteration_losses, read_events, run_job

MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "16", "--train-iters", "24",
]


def test_two_x_slow_rank_is_adapted_in_place_and_training_stays_exact(tmp_path):
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(1, [*MODEL, "--resihp-event-log", str(ref_log)]))
    check(run_job(8, [*MODEL, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--resihp-enable", "--resihp-event-log", str(log), "--resihp-inject", "slow:rank=3,factor=2,at=6"]))
    assert len(read_events(log, "start")) == 8  # one start per process: nothing restarted
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    assert any(v["ranks"] == [3] and v["factor"] == pytest.approx(2.0, rel=0.2) for v in verdicts), verdicts
    adapted = read_events(log, "adapted")
    assert adapted and adapted[0]["iteration"] >= 6
    ours, ref = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, 25))
    assert [ours[i] for i in range(1, 25)] == pytest.approx([ref[i] for i in range(1, 25)], rel=1e-5)
