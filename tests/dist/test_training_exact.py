"""Parallelism and checkpoints are exact: real megatron-core, real gloo processes."""

import pytest

from tests.dist.launch import TINY_GPT, check, iteration_losses, run_job

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _losses(tmp_path, name, nproc, extra, iters=4):
    log = tmp_path / f"{name}.jsonl"
    check(run_job(nproc, [*TINY_GPT, *NO_DROPOUT, "--train-iters", str(iters), "--resihp-event-log", str(log), *extra]))
    losses = iteration_losses(log)
    assert sorted(losses) == list(range(1, iters + 1))
    return [losses[i] for i in range(1, iters + 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), "ref", 1, [])


@pytest.mark.parametrize(
    "layout", [[], ["--pipeline-model-parallel-layout", "Ettt|tL"], ["--decoder-first-pipeline-num-layers", "1"]],
    ids=["even", "layout-3-1", "first-1"],
)
def test_tp2_pp2_dp2_matches_single_process(tmp_path, layout, reference):
    parallel = _losses(tmp_path, "par", 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *layout])
    assert reference[-1] < reference[0]
    assert parallel == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    # Dropout stays on: resuming must restore every rank's RNG streams, not just the weights.
    shape = ["--pipeline-model-parallel-size", "2", "--train-iters", "6"]
    full_log, first_log, resumed_log = (tmp_path / f"{n}.jsonl" for n in ("full", "first", "resumed"))
    check(run_job(4, [*TINY_GPT, *shape, "--resihp-event-log", str(full_log)]))
    ckpt = tmp_path / "ckpt"
    # Same LR schedule as the full run (decay over 6 iterations), stopped after 3.
    check(run_job(4, [*TINY_GPT, "--pipeline-model-parallel-size", "2", "--train-iters", "3", "--lr-decay-iters", "6",
                      "--save", str(ckpt), "--resihp-event-log", str(first_log)]))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not list(ckpt.glob("*.tmp"))
    # Resumed as users launch Megatron.
    check(run_job(4, [*TINY_GPT, *shape, "--load", str(ckpt), "--resihp-event-log", str(resumed_log)],
                  launcher="torchrun"))
    full, resumed = iteration_losses(full_log), iteration_losses(resumed_log)
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 5, 6)] == pytest.approx([full[i] for i in (4, 5, 6)], rel=1e-6)
