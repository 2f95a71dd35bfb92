"""Fail-slow handled in place: detected, planned and applied inside the same processes.

Throughput gains are measured by scripts/bench/adaptation.py; this test checks the behaviour:
the verdict names the rank slowed after the detector's warm-up, a plan is applied without a restart, and training stays exact
(losses equal a failure-free run's whatever the plan moved or rebalanced).
"""

import pytest

from tests.dist.launch import check, iteration_losses, read_events, run_job

MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "16", "--train-iters", "28",
]


def test_slow_rank_is_adapted_in_place_and_training_stays_exact(tmp_path):
    # PP2 x DP2 on 4 processes, on the host's shared cores as they are (no device emulation).
    # Rank 3 is replica 1, stage 1.
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(1, [*MODEL, "--resihp-event-log", str(ref_log)]))
    check(run_job(4, [*MODEL, "--pipeline-model-parallel-size", "2", "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=3,factor=3,at=10"]))
    assert len(read_events(log, "start")) == 4  # one start per process: nothing restarted
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    named = [v for v in verdicts if v["ranks"] == [3] and v["factor"] == pytest.approx(3.0, rel=0.2)]
    assert named, verdicts
    # The slowed rank's verdict is acted on in place (a noise verdict before the fault may also be).
    plans = read_events(log, "plan")
    assert any(p["iteration"] >= named[0]["iteration"] for p in plans), (plans, named)
    assert read_events(log, "adapted"), plans
    ours, ref = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, 29))
    assert [ours[i] for i in range(1, 29)] == pytest.approx([ref[i] for i in range(1, 29)], rel=1e-5)


def test_tp2_pp2_dp2_rank_slowed_2x_at_iteration_10_is_replanned_in_place(tmp_path):
    # The shape of the issue: TP2 x PP2 x DP2 on 8 processes, rank 7 (replica 1, last stage, TP
    # rank 1) slowed 2x at iteration 10. Each rank emulates a device of its own
    # (--cpu-device-time-scale), so the slow rank bounds its pipeline as it would on GPUs.
    shape = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--cpu-device-time-scale", "4"]
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    short = [a if a != "28" else "16" for a in MODEL]
    check(run_job(8, [*short, *shape, "--resihp-event-log", str(ref_log)]))
    check(run_job(8, [*short, *shape, "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=7,factor=2,at=10"]))
    assert len(read_events(log, "start")) == 8
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    named = [v for v in verdicts if v["ranks"] == [7] and v["factor"] == pytest.approx(2.0, rel=0.2)]
    assert named and named[0]["iteration"] <= 13, verdicts
    adapted = [a for a in read_events(log, "adapted") if a["iteration"] >= named[0]["iteration"]]
    assert adapted, read_events(log, "plan")
    ours, ref = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, 17))
    assert [ours[i] for i in range(1, 17)] == pytest.approx([ref[i] for i in range(1, 17)], rel=1e-5)


def test_rank_killed_while_a_replan_moves_state_leaves_survivors_on_the_old_layout(tmp_path):
    # PP2 x DP2 with an emulated device per rank, so moving a layer off the slowed rank 3 pays.
    # Rank 2 (replica 1, stage 0, the receiving end of that move) is killed while the moves run:
    # the survivors go back to the layout all of them still hold whole, and the fail-stop
    # recovery continues on replica 0 from there, exactly.
    shape = ["--pipeline-model-parallel-size", "2", "--cpu-device-time-scale", "4"]
    short = [a if a != "28" else "18" for a in MODEL]
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(1, [*short, "--resihp-event-log", str(ref_log)]))
    proc = run_job(4, [*short, *shape, "--resihp-enable", "--resihp-collective-timeout-s", "5",
                       "--resihp-event-log", str(log), "--resihp-inject", "slow:rank=3,factor=3,at=6",
                       "--resihp-inject", "kill:rank=2,at=6,during=replan"], launcher="local")
    check(proc)
    output = proc.stdout + proc.stderr
    assert "rank 2: injecting kill:rank=2,at=6,during=replan" in output, output[-3000:]
    assert "back on the old layout" in output, output[-3000:]
    adapted = read_events(log, "adapted")
    assert [(a["world_size"], a["failed_ranks"]) for a in adapted] == [(2, [2])], adapted
    ours, ref = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, 19))
    assert [ours[i] for i in range(1, 19)] == pytest.approx([ref[i] for i in range(1, 19)], rel=1e-5)
