"""Megatron-LM's asynchronous checkpoint saves (``--async-save``) under resilience.

Each save hands its tensors to a writer process per rank and returns; Megatron finalizes it at a
later step's top. A rank killed as the save is handed over, or while Megatron finalizes it, is
survived in place: the survivors drop what their writers held and save the iteration again on the
re-formed world (a save whose iteration a later step has passed is lost instead); every logged
loss, the checkpoint made again and the last one equal a failure-free run of stock Megatron-LM
with the same flags, and stock Megatron-LM resumes from the checkpoint made again. A dropped
replica and its readmission finish the saves still being written in the world that planned them
before they change that world.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check, read_events, run_job
from tests.dist.megatron_jobs import (
    ITERATIONS, assert_stock_training, checkpoint_tensors, job_args, logged_losses, quick_standby_flags, replaced,
    resilience_flags, stock_dist_training,
)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

# megatron-core 0.19.2 keeps --async-save on only with its persistent writer; its own strategy
# (nvidia-resiliency-ext's is the default) is the one resilience carries.
ASYNC = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


def async_job_args(tmp, **changes: str) -> list[str]:
    values = {"--ckpt-format": "torch_dist", "--save-interval": "2", **changes}
    return [*replaced(job_args(tmp, "ckpt"), values), *ASYNC]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Stock Megatron-LM with asynchronous saves: its losses and last checkpoint, and its folder."""
    tmp = tmp_path_factory.mktemp("async_failure_free")
    return (*stock_dist_training(8, tmp, async_job_args(tmp)), tmp)


def test_stock_megatron_finishes_every_asynchronous_save_on_cpu_ranks(stock):
    _, _, tmp = stock
    root = tmp / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    assert sorted(p.name for p in root.glob("iter_*")) == [f"iter_{i:07d}" for i in (2, 4, 6, 8)]
    assert all((p / ".metadata").exists() for p in root.glob("iter_*"))


def processes_naming(path) -> list[int]:
    """The live processes whose command line names ``path`` (a forked writer has its rank's)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


@pytest.mark.parametrize("phase", ["save-scheduled", "finalize"])
def test_a_rank_killed_while_a_save_is_written_is_survived_and_the_save_made_again_whole(tmp_path, stock, phase):
    # Rank 5 dies once its save of iteration 4 is with its writer, or as Megatron finalizes that
    # save at iteration 5's top: no step has run since, so the survivors save iteration 4 again.
    losses, tensors, stock_tmp = stock
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*async_job_args(tmp_path), *resilience_flags(events),
                       "--resihp-inject", f"kill:rank=5,at=4,during={phase}"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["failed_ranks"]) for a in adapted] == [(4, [5])], adapted
    dropped = read_events(events, "saves_settled")
    # Iteration 2's save may still be being written too (Megatron finalizes a save once every
    # rank's writer is done): it is lost, and later saves come at their interval.
    assert dropped and all(not d["kept"] and d["iterations"][-1] == 4 for d in dropped), dropped
    assert "resihp: saving iteration 4 again, on the re-formed world" in proc.stdout
    # The killed rank's writer and the process serving its writer's reports died with it; the
    # survivors' writers were stopped as their ranks finished.
    deadline = time.monotonic() + 10  # the kernel signals them as their rank goes
    while processes_naming(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_naming(tmp_path) == []
    assert_stock_training(proc.stdout, tmp_path, (losses, tensors), ITERATIONS)
    again = checkpoint_tensors(tmp_path / "ckpt", tmp_path, iteration=4)
    want = checkpoint_tensors(stock_tmp / "ckpt", stock_tmp, iteration=4)
    assert sorted(again) == sorted(want)
    for name, value in want.items():
        atol = 1e-5 if name.endswith("linear_qkv.bias") else 1e-6  # why: ``assert_stock_training``
        torch.testing.assert_close(again[name], value, rtol=1e-5, atol=atol, msg=name)
    if phase == "finalize":
        # Stock Megatron-LM resumes from the save made again and trains the rest as it would have.
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
        resumed = run_job(8, [*async_job_args(tmp_path), "--load", str(tmp_path / "ckpt")], timeout_s=420)
        check(resumed)
        got = logged_losses(resumed.stdout)
        assert sorted(got) == list(range(5, ITERATIONS + 1)), resumed.stdout[-3000:]
        # A resumed Megatron-LM logs its first iteration without restarting its loss average.
        assert got[5] == pytest.approx(losses[5], rel=1e-5)
        assert got[6] == pytest.approx((losses[5] + losses[6]) / 2, rel=1e-5)
        assert all(got[i] == pytest.approx(losses[i], rel=1e-5) for i in range(7, ITERATIONS + 1)), (got, losses)


def test_a_save_still_being_written_when_a_later_step_fails_is_lost_and_the_next_one_made(tmp_path, stock):
    # Rank 5 dies in step 5. Iteration 4's save was handed over at the end of iteration 4, and rank
    # 2's writer is held back 300 s by a storage stall, so Megatron cannot have finalized it: it is
    # dropped, and since step 5 has run it cannot be made again. Rank 2's stalled writer is killed
    # with the save (the later saves would otherwise queue behind it and the job's last one wait out
    # the stall), and the later saves are whole.
    losses, tensors, _ = stock
    events = tmp_path / "events.jsonl"
    started = time.monotonic()
    proc = run_job(8, [*async_job_args(tmp_path), *resilience_flags(events), "--resihp-inject", "kill:rank=5,at=5",
                       "--resihp-inject", "stall:rank=2,at=4,seconds=300"], timeout_s=420)
    check(proc)
    assert time.monotonic() - started < 300, "the job waited out the stalled writer"
    assert "saving iteration 4 again" not in proc.stdout
    assert [e["fault"] for e in read_events(events, "inject") if e["fault"].startswith("stall")] == [
        "stall:rank=2,at=4,seconds=300"]
    assert_stock_training(proc.stdout, tmp_path, (losses, tensors), ITERATIONS)
    dropped = read_events(events, "saves_settled")
    assert dropped and all(not d["kept"] and d["iterations"][-1] == 4 for d in dropped), dropped
    assert "resihp: the checkpoint of iteration 4 is lost to the failure" in proc.stdout


STANDBY_ITERATIONS = 32


def pp2_dp2_async_args(tmp) -> list[str]:
    """PP2 x DP2 on 4 ranks, a save at every iteration: the one of the iteration before is
    nearly always still being written (Megatron finalizes a save once every writer is done)."""
    return [*replaced(job_args(tmp, "ckpt"), {
        "--train-iters": str(STANDBY_ITERATIONS), "--tensor-model-parallel-size": "1", "--ckpt-format": "torch_dist",
        "--save-interval": "1"}), *ASYNC]


def test_a_replica_dropped_and_taken_back_finishes_the_saves_being_written_before_each_change(tmp_path_factory,
                                                                                                tmp_path):
    # Rank 3 runs 16x slow in iterations 5..14: its replica is dropped (its ranks stand by) and
    # taken back once healthy. Both changes rebuild the world the saves were planned in, so each
    # finishes them first, and every checkpoint stays stock Megatron-LM's.
    stock_tmp = tmp_path_factory.mktemp("pp2_dp2_async_failure_free")
    failure_free = stock_dist_training(4, stock_tmp, pp2_dp2_async_args(stock_tmp))
    events = tmp_path / "events.jsonl"
    # The trial is off (--resihp-verify-iters 0): a re-plan that leaves ranks out is never on trial.
    proc = run_job(4, [*pp2_dp2_async_args(tmp_path), *resilience_flags(events), "--resihp-verify-iters", "0",
                       *quick_standby_flags(),
                       "--resihp-inject", "slow:rank=3,factor=16,at=5,until=14"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [a["world_size"] for a in adapted] == [2, 4], adapted
    settled = read_events(events, "saves_settled")
    assert settled and all(s["kept"] for s in settled), settled
    assert {s["iteration"] for s in settled} <= {a["iteration"] for a in adapted}, (settled, adapted)
    assert_stock_training(proc.stdout, tmp_path, failure_free, STANDBY_ITERATIONS)
