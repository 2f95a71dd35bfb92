"""Resilience on Megatron-LM's own training loop (``--resihp-loop megatron``), 8 CPU ranks TP2 x PP2 x DP2.

A rank SIGKILLed mid-run is survived in place: the survivors re-form without it, Megatron's loop goes
on to its last iteration, and every logged loss and the saved weights equal a failure-free run of
stock Megatron-LM (no ``--resihp-*`` flag). What the fail-stop path cannot carry yet is refused
before anything starts.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.launch import check, read_events, run_job
from tests.dist.test_megatron_loop import logged_losses

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

ITERATIONS = 8


def job_args(tmp, name: str) -> list[str]:
    """A small GPT on TP2 x PP2 x DP2, dropout off (so that parameters can be compared exactly)."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--weight-decay", "0.1", "--init-method-std", "0.02",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--split", "99,1,0",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--device", "cpu",
        "--save", str(tmp / name), "--save-interval", "1000", "--ckpt-format", "torch",
    ]


def saved_weights(root) -> dict[str, torch.Tensor]:
    """Every (TP, PP) shard's model tensors of the last checkpoint under ``root``, by file and name."""
    iteration = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    weights = {}
    for path in sorted((root / f"iter_{int(iteration):07d}").glob("mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)["model"]
        weights.update({f"{path.parent.name}/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return weights


def test_a_sigkilled_rank_is_survived_in_place_with_the_failure_free_runs_losses_and_weights(tmp_path):
    baseline = run_job(8, job_args(tmp_path, "baseline"), timeout_s=420)
    assert baseline.returncode == 0, baseline.stdout[-3000:] + baseline.stderr[-3000:]
    events = tmp_path / "events.jsonl"
    killed = run_job(8, [*job_args(tmp_path, "killed"), "--resihp-loop", "megatron", "--resihp-enable",
                         "--resihp-event-log", str(events), "--resihp-inject", "kill:rank=5,at=4"], timeout_s=420)
    check(killed)  # the launcher reports a job that survived its failure as finished
    assert "adapted in place" in killed.stdout + killed.stderr, killed.stdout[-3000:]
    adapted = read_events(events, "adapted")
    assert adapted and adapted[0]["iteration"] == 4 and adapted[0]["world_size"] == 4, adapted
    expected, got = logged_losses(baseline.stdout), logged_losses(killed.stdout)
    assert sorted(expected) == list(range(1, ITERATIONS + 1)), baseline.stdout[-2000:]
    assert sorted(got) == sorted(expected), killed.stdout[-3000:]
    for i in expected:
        assert got[i] == pytest.approx(expected[i], rel=1e-5), (i, got[i], expected[i])
    want, have = saved_weights(tmp_path / "baseline"), saved_weights(tmp_path / "killed")
    assert want and sorted(have) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(have[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("flags, named", [
    (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--resihp-inject", "slow:rank=1,factor=2,at=3"], "--resihp-inject slow"),
], ids=["distributed-optimizer", "context-parallel", "fail-slow-injection"])
def test_what_the_fail_stop_path_cannot_carry_is_refused_before_anything_starts(tmp_path, flags, named):
    proc = run_job(8, [*job_args(tmp_path, "ckpt"), "--resihp-loop", "megatron", "--resihp-enable", *flags],
                   timeout_s=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert named in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists()
