"""Helpers for the tests that run the project's own loop (``--resihp-loop resihp``): a small GPT
job's flags, and the comparison of a run's losses, parameters and consumed samples with a
failure-free reference's."""

import pytest
import torch

from tests.dist.launch import OWN_LOOP, iteration_losses

MODEL = [
    *OWN_LOOP, "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]
RESILIENT = ["--resihp-enable", "--resihp-collective-timeout-s", "5"]


def saved_params(checkpoint, iteration):
    """Every (TP, PP) shard's saved state at ``iteration`` under ``checkpoint``, by shard folder."""
    shards = {}
    for path in sorted((checkpoint / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        shards[path.parent.name] = state
    return shards


def assert_same_params(a, b, tol=1e-5):
    """Both runs' shards hold the same consumed samples and model tensors (to ``tol``)."""
    assert a.keys() == b.keys() and a
    for shard in a:
        assert a[shard]["consumed_samples"] == b[shard]["consumed_samples"]
        for name, value in a[shard]["model"].items():
            if torch.is_tensor(value) and value.is_floating_point():
                torch.testing.assert_close(b[shard]["model"][name], value, rtol=0, atol=tol, msg=f"{shard} {name}")


def assert_same_training(log, checkpoint, reference, global_batch, param_tol=1e-5):
    """Losses of iterations 1-8, parameters and consumed samples after 8 equal the reference's."""
    ref_ckpt, ref_losses = reference
    losses = iteration_losses(log)
    assert [losses[i] for i in range(1, 9)] == pytest.approx([ref_losses[i] for i in range(1, 9)], rel=1e-5)
    ours = saved_params(checkpoint, 8)
    assert {s["consumed_samples"] for s in ours.values()} == {8 * global_batch}
    assert_same_params(saved_params(ref_ckpt, 8), ours, tol=param_tol)
