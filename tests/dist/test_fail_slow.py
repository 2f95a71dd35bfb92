"""Fail-slow handled in place: detected, planned and applied inside the same processes.

Throughput gains are measured by scripts/bench/adaptation.py; this test checks the behaviour:
the verdict names the rank slowed after the detector's warm-up, a plan is applied without a restart, and training stays exact
(losses equal a failure-free run's whatever the plan moved or rebalanced).
"""

import pytest

from tests.dist.launch import check, decisions, iteration_losses, read_events, run_job

MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "16", "--train-iters", "34",
]


def test_slow_ranks_are_adapted_in_place_one_after_another_and_training_stays_exact(tmp_path):
    # PP2 x DP2 on 4 processes, on the host's shared cores as they are (no device emulation).
    # Rank 3 (replica 1, stage 1) slows at iteration 10, rank 0 (replica 0, stage 0) at 22, once
    # the detector has warmed up again after the first re-plan.
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(1, [*MODEL, "--resihp-event-log", str(ref_log)]))
    check(run_job(4, [*MODEL, "--pipeline-model-parallel-size", "2", "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=3,factor=3,at=10", "--resihp-inject", "slow:rank=0,factor=3,at=22"]))
    assert len(read_events(log, "start")) == 4  # one start per process: nothing restarted
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    first = [v for v in verdicts if v["ranks"] == [3] and v["factor"] == pytest.approx(3.0, rel=0.2)]
    second = [v for v in verdicts if v["ranks"] == [0] and v["factor"] == pytest.approx(3.0, rel=0.2)
              and v["iteration"] >= 22]
    assert first and second, decisions(log)
    # Each verdict is acted on in place (a noise verdict before the fault may also be); the plan
    # after the second still knows the first slow rank, so quotas stay away from both.
    plans = read_events(log, "plan")
    assert any(p["iteration"] >= first[0]["iteration"] for p in plans), decisions(log)
    last = [p for p in plans if p["iteration"] >= second[0]["iteration"]]
    assert last and {"0", "3"} <= set(last[0]["slow_rank_factors"]), decisions(log)
    assert len([a for a in read_events(log, "adapted") if a["iteration"] >= first[0]["iteration"]]) >= 2, decisions(log)
    ours, ref = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, 35))
    assert [ours[i] for i in range(1, 35)] == pytest.approx([ref[i] for i in range(1, 35)], rel=1e-5)


ISSUE_SHAPE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--cpu-device-time-scale", "4"]
ITERS = 16
SHORT = [a if a != "34" else str(ITERS) for a in MODEL]


@pytest.fixture(scope="module")
def issue_shape_reference(tmp_path_factory):
    """Failure-free losses of the issue's shape (emulated devices, K = 4)."""
    ref_log = tmp_path_factory.mktemp("issue_shape_reference") / "ref.jsonl"
    check(run_job(8, [*SHORT, *ISSUE_SHAPE, "--resihp-event-log", str(ref_log)]))
    return iteration_losses(ref_log)


def test_tp2_pp2_dp2_rank_slowed_2x_at_iteration_10_is_replanned_in_place(tmp_path, issue_shape_reference):
    # The shape of the issue: TP2 x PP2 x DP2 on 8 processes, rank 7 (replica 1, last stage, TP
    # rank 1) slowed 2x at iteration 10. Each rank emulates a device of its own
    # (--cpu-device-time-scale), so the slow rank bounds its pipeline as it would on GPUs.
    log = tmp_path / "events.jsonl"
    check(run_job(8, [*SHORT, *ISSUE_SHAPE, "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=7,factor=2,at=10"]))
    assert len(read_events(log, "start")) == 8
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    named = [v for v in verdicts if v["ranks"] == [7] and v["factor"] == pytest.approx(2.0, rel=0.2)]
    assert named and named[0]["iteration"] <= 13, decisions(log)
    adapted = [a for a in read_events(log, "adapted") if a["iteration"] >= named[0]["iteration"]]
    assert adapted, decisions(log)
    ours = iteration_losses(log)
    assert sorted(ours) == list(range(1, ITERS + 1))
    assert [ours[i] for i in range(1, ITERS + 1)] == pytest.approx(
        [issue_shape_reference[i] for i in range(1, ITERS + 1)], rel=1e-5)
