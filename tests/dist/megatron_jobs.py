"""Helpers for the tests that run Megatron-LM's own loop: a small GPT job, stock Megatron-LM's
failure-free run of it, and the comparison of a resilient run's losses and saved weights with it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check, run_job

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


def logged_losses(stdout: str) -> dict[int, float]:
    """The lm loss Megatron logged for each iteration."""
    return {int(i): float(v) for i, v in _LOSS.findall(stdout)}


_EVALUATED = re.compile(r"validation loss at (iteration [^|]*?) \| lm loss value: (\S+)")


def evaluated_losses(stdout: str) -> dict[str, float]:
    """Megatron's evaluated lm loss, by what its line says was evaluated: ``iteration 4``, and at the
    end ``iteration 8 on validation set`` and ``iteration 8 on test set``."""
    return {what: float(v) for what, v in _EVALUATED.findall(stdout)}


ITERATIONS = 8


def job_args(tmp, name: str) -> list[str]:
    """A small GPT on TP2 x PP2 x DP2, dropout off (so that parameters can be compared exactly).

    The data is read in each rank (``--num-workers 0``): Megatron's default of two loader workers
    per rank puts 16 more processes on a 2-core host and passes every batch through shared memory,
    and an 8-rank job of 20 iterations ran 338-407 ms an iteration without them against 491-496
    with. The example-script tests and the Slurm jobs keep workers, as users' scripts do."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--weight-decay", "0.1", "--init-method-std", "0.02",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--split", "99,1,0",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--device", "cpu",
        "--save", str(tmp / name), "--save-interval", "1000", "--ckpt-format", "torch", "--num-workers", "0",
    ]


def distributed_job_args(tmp, name: str) -> list[str]:
    """``job_args`` with the distributed optimizer and sequence parallelism, saved in ``torch_dist``
    with the optimizer's state laid out by parameter (``--dist-ckpt-optim-fully-reshardable``), so
    that a save loads whatever layer split or TP degree wrote it."""
    return [*replaced(job_args(tmp, name), {"--ckpt-format": "torch_dist"}), "--dist-ckpt-optim-fully-reshardable",
            "--use-distributed-optimizer", "--sequence-parallel"]


def saved_weights(root) -> dict[str, torch.Tensor]:
    """Every (TP, PP) shard's model tensors of the last checkpoint under ``root``, by file, model chunk
    (``model``, or under the interleaved schedule ``model0``, ``model1``, ...) and name."""
    iteration = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    weights = {}
    for path in sorted((root / f"iter_{int(iteration):07d}").glob("mp_rank_*/model_optim_rng.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        for chunk in (key for key in saved if key == "model" or (key.startswith("model") and key[5:].isdigit())):
            weights.update({f"{path.parent.name}/{chunk}/{k}": v for k, v in saved[chunk].items()
                            if isinstance(v, torch.Tensor)})
    return weights


def saved_states(root) -> dict[str, dict]:
    """Every (TP, PP) shard's whole saved state of the last ``torch``-format checkpoint under ``root``, by folder."""
    iteration = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    return {path.parent.name: torch.load(path, map_location="cpu", weights_only=False)
            for path in sorted((root / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt"))}


def stock_training(nproc: int, args: list[str]) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Stock Megatron-LM's loop on ``nproc`` ranks, no ``--resihp-*`` flag: the losses it logs for
    every iteration and the weights it saves under ``--save``."""
    proc = run_job(nproc, args, timeout_s=420)
    check(proc)
    return training_of(proc, args)


def stock_dist_training(nproc: int, tmp, args: list[str]) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Stock Megatron-LM's loop on ``nproc`` ranks saving in ``torch_dist`` under ``tmp / "ckpt"``, no
    ``--resihp-*`` flag: the losses it logs for every iteration and every floating-point tensor of
    its last checkpoint (``checkpoint_tensors``)."""
    proc = run_job(nproc, args, timeout_s=420)
    check(proc)
    return logged_losses(proc.stdout), checkpoint_tensors(tmp / "ckpt", tmp)


def training_of(proc, args: list[str]) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """What a finished run of ``args`` trained: the loss logged for every iteration and the weights
    saved under ``--save``."""
    losses = logged_losses(proc.stdout)
    assert sorted(losses) == list(range(1, int(args[args.index("--train-iters") + 1]) + 1)), proc.stdout[-2000:]
    return losses, saved_weights(Path(args[args.index("--save") + 1]))


HEADS = 4  # job_args' attention heads (no query groups): a QKV bias is (head, q/k/v, head dim)


def assert_same_losses(stdout: str, failure_free, iterations=range(1, ITERATIONS + 1)) -> None:
    """Every iteration in ``iterations`` logged once, with the failure-free run's loss."""
    expected = dict(failure_free[0])
    if iterations[0] > 1:
        # A resumed Megatron-LM logs its first iteration without restarting its loss average, so the
        # second line reports the mean of both (megatron.training.training_log, is_first_iteration).
        first, second = iterations[0], iterations[1]
        expected[second] = (expected[first] + expected[second]) / 2
    got = logged_losses(stdout)
    assert sorted(got) == list(iterations), stdout[-3000:]
    for i in iterations:
        assert got[i] == pytest.approx(expected[i], rel=1e-5), (i, got[i], expected[i])


def assert_same_training(stdout: str, root, failure_free, iterations=range(1, ITERATIONS + 1),
                         key_bias_atol: float | None = None) -> None:
    """Every iteration in ``iterations`` logged once with the failure-free loss, and the weights saved
    under ``root`` equal the failure-free run's.

    ``key_bias_atol``: the bound for the key third of each QKV bias, when the data-parallel size
    changed more than once. Its true gradient is zero (softmax ignores what is added to every
    score of a query alike), so what it gets is rounding noise of the reduction order, which Adam
    scales up to steps of the learning rate's size."""
    assert_same_losses(stdout, failure_free, iterations)
    want = failure_free[1]
    have = saved_weights(root)
    assert want and sorted(have) == sorted(want)
    for name, value in want.items():
        got_value = have[name]
        if key_bias_atol is not None and name.endswith("linear_qkv.bias"):
            keys = (slice(None), 1)
            torch.testing.assert_close(got_value.view(HEADS, 3, -1)[keys], value.view(HEADS, 3, -1)[keys],
                                       rtol=0, atol=key_bias_atol, msg=name)
            got_value, value = got_value.view(HEADS, 3, -1)[:, 0::2], value.view(HEADS, 3, -1)[:, 0::2]
        torch.testing.assert_close(got_value, value, rtol=1e-5, atol=1e-6, msg=name)


def checkpoint_tensors(root, scratch, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of the last ``torch_dist`` checkpoint under ``root`` (or of
    ``iteration``'s), whole (as the model has it, whatever split saved it), by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if iteration is None:
        iteration = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    flat = scratch / f"{root.name}-{iteration}.pt"
    dcp_to_torch_save(root / f"iter_{iteration:07d}", flat)
    state = torch.load(flat, map_location="cpu", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def assert_stock_training(stdout: str, tmp, failure_free, iterations: int) -> None:
    """Every logged loss, and every tensor of the checkpoint saved under ``tmp / "ckpt"``, equal the
    failure-free run's (``failure_free``: its losses and tensors)."""
    expected, want = failure_free
    got = logged_losses(stdout)
    assert sorted(got) == list(range(1, iterations + 1)), stdout[-3000:]
    for i in got:
        assert got[i] == pytest.approx(expected[i], rel=1e-5), (i, got[i], expected[i])
    have = checkpoint_tensors(tmp / "ckpt", tmp)
    assert sorted(have) == sorted(want)
    for name, value in want.items():
        # Attention is invariant to the key part of the QKV bias, so its gradient is rounding noise,
        # which Adam scales up towards its step size: after a move Megatron sums the gradient
        # norm over other stages, and those elements (about 1e-6 in size) differ by about as much,
        # while their moments agree to 1e-9.
        atol = 1e-5 if name.endswith("linear_qkv.bias") else 1e-6
        torch.testing.assert_close(have[name], value, rtol=1e-5, atol=atol, msg=name)


def resilient(tmp, events) -> list[str]:
    return [*job_args(tmp, "ckpt"), *resilience_flags(events)]


def resilience_flags(events) -> list[str]:
    """Resilience on Megatron-LM's loop, its events written to ``events``."""
    return ["--resihp-enable", "--resihp-event-log", str(events)]


def quick_standby_flags() -> list[str]:
    """Standbys that probe every 0.1 s, judged healthy below 2x their reference probe.

    A readmission must pay within the few iterations these jobs have left once a slowdown ends, so
    standbys probe often; their report (the least of their last 3 probes) then spans 0.3 s, while a
    core of this kind of shared host runs up to 1.7x slow for seconds at a time. At the default 1.2x
    bound, two healthy standbys of one replica were seen ready in turns for 1.5 s (9 iterations),
    too late for the readmission to pay. The injected slowdowns are 8x and more, so 2x still tells
    them apart."""
    return ["--resihp-standby-probe-interval-s", "0.1", "--resihp-probe-threshold", "2"]


def replaced(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the value after each flag in ``values`` replaced."""
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def wait_for(condition, timeout_s: float, log) -> None:
    """Poll ``condition`` until it holds; past ``timeout_s``, fail with the end of ``log``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
