"""A rank killed while a checkpoint is saved, or as a finished job ends: real processes, real SIGKILLs.

Each phase of a save (before its files, while they are written, before the rename of
``iter_X.tmp``, between the rename and the tracker file) is survived in place: the survivors
recover, save the iteration again on the new world unless the save had completed, and finish with
the parameters of a failure-free run. Where no in-place plan exists the job ends with the fallback
(exit 3) and its resume command; a kill as the job ends leaves a finished job's exit code 0. No
interrupted save is ever named by the tracker file.
"""

import shlex
import subprocess

import pytest
import torch

from scripts.child_env import job_env
from tests.dist.launch import EXACT_GPT, REPO, check, iteration_losses, read_events, run_job

# TP1 x PP2: on 4 ranks, rank = replica + 2 * stage; ranks 0 and 1 write the shards (replica 0).
SHAPE = [*EXACT_GPT, "--pipeline-model-parallel-size", "2", "--train-iters", "6", "--save-interval", "2"]
RESILIENT = ["--resihp-enable", "--resihp-collective-timeout-s", "5"]
ITERATIONS = 6
GLOBAL_BATCH = 16


def _shards(checkpoint, iteration):
    return {path.parent.name: torch.load(path, weights_only=False)
            for path in sorted((checkpoint / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt"))}


def _assert_saved_like(checkpoint, reference_checkpoint, iteration):
    """The checkpoint of ``iteration`` holds the reference's parameters and consumed samples."""
    ours, ref = _shards(checkpoint, iteration), _shards(reference_checkpoint, iteration)
    assert ours.keys() == ref.keys() and ours, (sorted(ours), sorted(ref))
    for shard, state in ours.items():
        assert (state["iteration"], state["consumed_samples"]) == (iteration, iteration * GLOBAL_BATCH), shard
        for name, value in ref[shard]["model"].items():
            if torch.is_tensor(value) and value.is_floating_point():
                torch.testing.assert_close(state["model"][name], value, rtol=0, atol=1e-5, msg=f"{shard} {name}")


def _assert_complete(checkpoint, latest):
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == str(latest)
    assert not list(checkpoint.glob("*.tmp")), sorted(p.name for p in checkpoint.iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TP1 x PP2 x DP1, failure-free: the losses and checkpoints (2, 4, 6) every job must match."""
    tmp = tmp_path_factory.mktemp("reference")
    log = tmp / "events.jsonl"
    check(run_job(2, [*SHAPE, "--save", str(tmp / "ckpt"), "--resihp-event-log", str(log)]))
    return tmp / "ckpt", iteration_losses(log)


def _run(tmp_path, nproc, *faults, extra=()):
    log = tmp_path / "events.jsonl"
    proc = run_job(nproc, [*SHAPE, *RESILIENT, *extra, "--save", str(tmp_path / "ckpt"), "--resihp-event-log", str(log),
                           *(f"--resihp-inject={fault}" for fault in faults)])
    return proc, log, proc.stdout + proc.stderr


@pytest.mark.parametrize("phase, rank, saved_again", [
    ("save", 3, True),            # before any file of iteration 4 is written
    ("save-write", 2, True),      # rank 2 has written stage 1's shard, not its RNG file
    ("save-rename", 0, True),     # the renaming rank, with every file in iter_0000004.tmp
    ("save-tracker", 0, True),    # the renaming rank, after the rename, before the tracker moves
    ("save-rename", 3, False),    # another rank, while rank 0 renames: the save completes
])
def test_a_rank_killed_during_a_save_is_survived_in_place(tmp_path, reference, phase, rank, saved_again):
    proc, log, output = _run(tmp_path, 4, f"kill:rank={rank},at=4,during={phase}")
    assert proc.returncode == 0, output[-5000:]
    assert f"launch rank {rank}: injecting kill:rank={rank},at=4,during={phase}" in output
    assert f"launch_local: rank {rank} exited with signal SIGKILL" in output
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 2, [rank])], adapted
    assert not read_events(log, "fallback_checkpoint")
    said = ("saving iteration 4 again on the new world" if saved_again
            else "the save of iteration 4 had completed before the failure")
    assert output.count(said) == 2, output[-5000:]  # both ranks of the new world
    # Every iteration once, as the failure-free run trained it; every checkpoint as it saved it.
    ref_ckpt, ref_losses = reference
    losses = iteration_losses(log)
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    assert [losses[i] for i in sorted(losses)] == pytest.approx([ref_losses[i] for i in sorted(losses)], rel=1e-5)
    for iteration in (2, 4, 6):
        _assert_saved_like(tmp_path / "ckpt", ref_ckpt, iteration)
    _assert_complete(tmp_path / "ckpt", ITERATIONS)


def test_a_rank_killed_as_the_job_ends_leaves_it_finished(tmp_path, reference):
    proc, log, output = _run(tmp_path, 4, f"kill:rank=3,at={ITERATIONS},during=shutdown")
    assert proc.returncode == 0, output[-5000:]
    assert "launch_local: rank 3 exited with signal SIGKILL" in output
    assert output.count("a rank failed as the job ended") == 3, output[-5000:]
    assert {e["rank"] for e in read_events(log, "finish")} == {0, 1, 2, 3}
    _assert_saved_like(tmp_path / "ckpt", reference[0], ITERATIONS)
    _assert_complete(tmp_path / "ckpt", ITERATIONS)


def test_no_in_place_plan_during_a_save_falls_back_and_resumes(tmp_path, reference):
    # PP2 on 2 ranks: rank 1 holds stage 1 alone and dies with its shard half written, so the
    # survivor names the last complete checkpoint (iteration 2), never the interrupted one.
    ckpt = tmp_path / "ckpt"
    proc, log, output = _run(tmp_path, 2, "kill:rank=1,at=4,during=save-write")
    assert proc.returncode == 3, output[-5000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000004.tmp").is_dir() and not (ckpt / "iter_0000004").exists()
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1 and fallback[0]["path"] == str(ckpt / "iter_0000002"), fallback
    assert "iterations 3-4 are trained again" in fallback[0]["reason"]
    resumed_log = tmp_path / "resumed.jsonl"
    resume = fallback[0]["resume_command"].replace(str(log), str(resumed_log))
    check(subprocess.run(shlex.split(resume), cwd=REPO, capture_output=True, text=True, timeout=300, env=job_env()))
    ref_ckpt, ref_losses = reference
    resumed = iteration_losses(resumed_log)
    assert sorted(resumed) == list(range(3, ITERATIONS + 1))
    assert [resumed[i] for i in sorted(resumed)] == pytest.approx([ref_losses[i] for i in sorted(resumed)], rel=1e-5)
    _assert_saved_like(ckpt, ref_ckpt, ITERATIONS)
    _assert_complete(ckpt, ITERATIONS)  # the resumed run's first complete save removed the .tmp


def test_no_in_place_plan_during_a_save_assembles_that_iteration(tmp_path):
    # TP2 x PP2 x DP2 on 8 ranks (rank = tp + 2 * replica + 4 * stage) with devices of 4 MiB,
    # which hold stage 0 only at TP 2: ranks 1, 2 and 6 die writing iteration 4, leaving no
    # replica but every (stage, TP) shard. The survivors save iteration 4 itself (its step was
    # taken) from the shards they hold, with the samples it consumed.
    ckpt = tmp_path / "ckpt"
    proc, log, output = _run(tmp_path, 8, *(f"kill:rank={r},at=4,during=save-write" for r in (1, 2, 6)),
                             extra=["--tensor-model-parallel-size", "2", "--resihp-device-memory-gb", "0.004"])
    assert proc.returncode == 3, output[-5000:]
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1 and fallback[0]["path"] == str(ckpt / "iter_0000004"), fallback
    assert fallback[0]["resume_command"].endswith(f"--load {ckpt}")
    _assert_complete(ckpt, 4)
    shards = _shards(ckpt, 4)
    assert sorted(shards) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert {(s["iteration"], s["consumed_samples"]) for s in shards.values()} == {(4, 4 * GLOBAL_BATCH)}
