"""Every live replica kept on Megatron-LM's own loop when their count does not divide the global
batch: real processes, a real SIGKILL, 8 CPU ranks TP1 x PP2 x DP4, a global batch of 8 micro-batches.

Launch rank = replica + 4 * stage. Rank 7 (replica 3, stage 1) killed at iteration 3: replicas 0-2
go on with quotas of 3, 3 and 2 micro-batches (not 2 replicas, the largest count that divides 8),
rank 3 stands by as a spare. Megatron's own arithmetic holds throughout: its losses, its
evaluations every 2 iterations and at the end (validation and test sets), its consumed-sample
count and its saved weights equal stock Megatron-LM's failure-free run.
"""

from __future__ import annotations

import pytest

import torch

from tests.dist.launch import check, read_events, run_job
from tests.dist.megatron_jobs import assert_same_training, evaluated_losses, job_args, replaced, training_of

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

EVAL = ["--eval-iters", "1", "--eval-interval", "2"]


def _args(tmp):
    return [*replaced(job_args(tmp, "ckpt"), {"--tensor-model-parallel-size": "1"}), *EVAL]


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """Stock Megatron-LM, failure-free: (its losses and saved weights, its evaluated losses, what its
    last checkpoint counted)."""
    tmp = tmp_path_factory.mktemp("failure_free")
    args = _args(tmp)
    proc = run_job(8, args, timeout_s=420)
    check(proc)
    return training_of(proc, args), evaluated_losses(proc.stdout), _counted(tmp / "ckpt")


def _counted(root):
    """The samples and floating-point operations the last checkpoint's ranks counted (each saves them).
    (A resilient run also saves as Megatron's micro-batch count changes, here at iteration 3.)"""
    last = int((root / "latest_checkpointed_iteration.txt").read_text())
    saved = [torch.load(path, map_location="cpu", weights_only=False)
             for path in root.glob(f"iter_{last:07d}/mp_rank_*/model_optim_rng.pt")]
    return {(s["args"].consumed_train_samples, s["num_floating_point_operations_so_far"]) for s in saved}


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["replicated", "distributed"])
def test_three_of_four_replicas_go_on_with_uneven_quotas_and_the_training_is_stock(tmp_path, stock_run, optimizer):
    failure_free, failure_free_evaluated, counted = stock_run
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*_args(tmp_path), *optimizer, "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=7,at=3"], timeout_s=420)
    check(proc)
    out = proc.stdout + proc.stderr
    assert len(read_events(events, "start")) == 8  # nothing restarted
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [(a["iteration"], a["failed_launch_ranks"], a["data_parallel_size"], sorted(a["quotas"]))
            for a in adapted] == [(3, [7], 3, [2, 3, 3])], out[-4000:]
    assert "launch rank 3 is a spare" in out or "stands by" in out, out[-4000:]
    assert not read_events(events, "fallback_checkpoint")
    # Megatron counted every sample once, 8 per iteration whatever the replicas' split, and the
    # FLOPs of those samples.
    ours = _counted(tmp_path / "ckpt")
    assert ours == counted and {c[0] for c in counted} == {64}, (ours, counted)
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
    evaluated = evaluated_losses(proc.stdout)
    assert sorted(evaluated) == sorted(failure_free_evaluated) and len(evaluated) == 6, proc.stdout[-3000:]
    for what, loss in failure_free_evaluated.items():
        assert evaluated[what] == pytest.approx(loss, rel=1e-5), (what, evaluated[what], loss)
