"""The training test on CUDA (world size 1, NCCL); skipped on machines without a GPU."""

import pytest
import torch

from tests.dist.launch import TINY_GPT, check, iteration_losses, run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_trains_on_cuda(tmp_path, precision):
    # Started by scripts/launch_local.py: its rank is forked from a server that imported torch and
    # megatron-core, so this also shows the fork left CUDA usable.
    args = [a if a != "cpu" else "cuda" for a in TINY_GPT]
    log = tmp_path / "events.jsonl"
    check(run_job(1, [*args, *precision, "--train-iters", "20", "--resihp-event-log", str(log)]))
    losses = iteration_losses(log)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1]


def test_cuda_matches_cpu_losses(tmp_path):
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3"]
    runs = {}
    for device in ("cpu", "cuda"):
        log = tmp_path / f"{device}.jsonl"
        args = [a if a != "cpu" else device for a in TINY_GPT]
        check(run_job(1, [*args, *no_dropout, "--resihp-event-log", str(log)]))
        runs[device] = iteration_losses(log)
    assert [runs["cuda"][i] for i in (1, 2, 3)] == pytest.approx([runs["cpu"][i] for i in (1, 2, 3)], rel=1e-3)
