"""Multi-GPU jobs on one node (NCCL between GPUs, gloo for host messages): training equals the CPU
run's, and a SIGKILLed rank is survived in place with the failure-free run's parameters.

Each test names the GPUs it needs and is skipped, with that reason, on a node with fewer.
``scripts/gpu_ci.sh`` runs this folder on whatever GPUs a node has.
"""

import pytest
import torch

from tests.dist.launch import check, iteration_losses, read_events, run_job, tiny_gpt_on

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# A CUDA job against a CPU job: both draw the weights from the CPU's generator
# (test_training_cuda.SAME_WEIGHTS says why).
SAME_WEIGHTS = ["--use-cpu-initialization"]
# Bounds every NCCL and gloo wait once a peer is dead (docs/launching.md, "NCCL settings").
RESILIENT = ["--resihp-enable", "--resihp-collective-timeout-s", "10"]
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def needs_gpus(count: int):
    return pytest.mark.skipif(NUM_GPUS < count, reason=f"needs {count} CUDA GPUs, this node has {NUM_GPUS}")


def _params(checkpoint, iteration):
    shards = {}
    for path in sorted((checkpoint / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt")):
        shards[path.parent.name] = torch.load(path, weights_only=False, map_location="cpu")
    return shards


@needs_gpus(2)
def test_dp2_on_two_gpus_matches_the_cpu_job(tmp_path):
    runs = {}
    for device in ("cpu", "cuda"):
        log = tmp_path / f"{device}.jsonl"
        check(run_job(2, [*tiny_gpt_on(device), *NO_DROPOUT, *SAME_WEIGHTS, "--train-iters", "4",
                          "--resihp-event-log", str(log)], env_extra=NCCL_ENV))
        losses = iteration_losses(log)
        runs[device] = [losses[i] for i in range(1, 5)]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3)


@needs_gpus(8)
def test_tp2_pp2_dp2_on_eight_gpus_matches_the_cpu_job(tmp_path):
    shape = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "4"]
    runs = {}
    for device in ("cpu", "cuda"):
        log = tmp_path / f"{device}.jsonl"
        check(run_job(8, [*tiny_gpt_on(device), *NO_DROPOUT, *SAME_WEIGHTS, *shape, "--resihp-event-log", str(log)],
                      env_extra=NCCL_ENV))
        losses = iteration_losses(log)
        runs[device] = [losses[i] for i in range(1, 5)]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3)


@needs_gpus(4)
def test_sigkill_on_nccl_is_survived_in_place_with_exact_parameters(tmp_path):
    """PP 2 x DP 2 on 4 GPUs, rank 1 SIGKILLed at iteration 3: the survivors abort their NCCL
    communicators instead of being torn down by NCCL's watchdog, re-form, and end with the
    failure-free run's losses, parameters and consumed samples."""
    shape = [*tiny_gpt_on("cuda"), *NO_DROPOUT, "--pipeline-model-parallel-size", "2", "--train-iters", "6"]
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    check(run_job(4, [*shape, "--save", str(ref / "ckpt"), "--resihp-event-log", str(ref / "ev.jsonl")],
                  env_extra=NCCL_ENV))
    proc = run_job(4, [*shape, *RESILIENT, "--save", str(ours / "ckpt"), "--resihp-event-log", str(ours / "ev.jsonl"),
                       "--resihp-inject", "kill:rank=1,at=3"], env_extra=NCCL_ENV)
    check(proc)
    assert "rank 1 exited with signal SIGKILL" in proc.stdout + proc.stderr
    assert len(read_events(ours / "ev.jsonl", "adapted")) == 1
    ref_losses, losses = iteration_losses(ref / "ev.jsonl"), iteration_losses(ours / "ev.jsonl")
    assert sorted(losses) == list(range(1, 7))
    assert [losses[i] for i in range(1, 7)] == pytest.approx([ref_losses[i] for i in range(1, 7)], rel=1e-4)
    a, b = _params(ref / "ckpt", 6), _params(ours / "ckpt", 6)
    assert a.keys() == b.keys() and a
    for shard in a:
        assert a[shard]["args"].consumed_train_samples == b[shard]["args"].consumed_train_samples == 6 * 16
        for name, value in a[shard]["model"].items():
            if torch.is_tensor(value) and value.is_floating_point():
                torch.testing.assert_close(b[shard]["model"][name], value, rtol=0, atol=1e-4, msg=f"{shard} {name}")


@needs_gpus(2)
def test_a_two_times_slow_gpu_is_replanned_in_place(tmp_path):
    """PP 2 on 2 GPUs, stage 1's GPU 2x slow from iteration 10: detected, and its layers move."""
    log = tmp_path / "ev.jsonl"
    args = [*tiny_gpt_on("cuda"), "--pipeline-model-parallel-size", "2", "--global-batch-size", "32",
            "--train-iters", "40",
            *RESILIENT, "--resihp-event-log", str(log), "--resihp-inject", "slow:rank=1,factor=2,at=10"]
    check(run_job(2, args, env_extra=NCCL_ENV, timeout_s=600))
    verdicts = [v for v in read_events(log, "verdict") if v.get("kind") == "compute"]
    assert verdicts and 1 in verdicts[0]["ranks"], f"no compute verdict on rank 1: {verdicts}"
    assert read_events(log, "adapted"), "the slow GPU was found but nothing was re-planned"
