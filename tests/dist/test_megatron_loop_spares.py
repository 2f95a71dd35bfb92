"""Spares on Megatron-LM's own loop: real processes, real SIGKILLs, 8 CPU ranks TP1 x PP2 x DP4.

Launch rank = replica + 4 * stage. A rank a fail-stop plan leaves out stands by outside Megatron's
``train()`` instead of exiting, and a later recovery gives it a dead rank's place: it receives that
place's state from a live holder and enters the loop again at the iteration the survivors redo.
Four kills, one per iteration: with spares leaving, the fourth finds no replica left whole and the
job can only be resumed from a checkpoint; with them standing by, it finishes in place, its losses
and saved weights equal to stock Megatron-LM's failure-free run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from scripts.child_env import job_env
from tests.dist.launch import REPO, assert_moved_as_planned, check, main_copies, read_events, run_job
from tests.dist.megatron_jobs import (assert_same_training, evaluated_losses, job_args, saved_states, training_of,
                                     wait_for)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

# A global batch of 12 micro-batches splits evenly over 4, 3 and 2 replicas.
SHAPE = {"--tensor-model-parallel-size": "1", "--global-batch-size": "12"}
# Kill 7 (stage 1 of replica 3): replicas 0-2 go on, rank 3 stands by. Kill 6: rank 3 takes its place,
# receiving stage 1 from a live holder, and DP stays 3. Kill 0: replicas (1 | 5) and (2 | 3) go on,
# rank 4 stands by. Kill 5: rank 4 takes its place; DP 2 to the end.
KILLS = [(7, 3), (6, 4), (0, 5), (5, 6)]


def _args(tmp, name):
    args = job_args(tmp, name)
    for flag, value in SHAPE.items():
        args[args.index(flag) + 1] = value
    return args


# An evaluation every 2 iterations: the spare that comes back at 4 reads the validation samples
# the survivors have reached.
EVAL = ["--eval-iters", "1", "--eval-interval", "2"]


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """Stock Megatron-LM, failure-free, evaluating every 2 iterations (which changes no training):
    (its losses and saved weights, its evaluated losses)."""
    args = [*_args(tmp_path_factory.mktemp("failure_free"), "ckpt"), *EVAL]
    proc = run_job(8, args, timeout_s=420)
    check(proc)
    return training_of(proc, args), evaluated_losses(proc.stdout)


@pytest.fixture(scope="module")
def failure_free(stock_run):
    return stock_run[0]


@pytest.fixture(scope="module")
def failure_free_evaluated(stock_run):
    return stock_run[1]


def _resilient(tmp_path, *extra):
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events), *extra,
                       *(f"--resihp-inject=kill:rank={r},at={at}" for r, at in KILLS)], timeout_s=600)
    return proc, events


# With the distributed optimizer a spare receives no weights: every part of its place's position
# (the dead rank's from its copy), and its parameters are gathered from their main parameters.
@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["replicated", "distributed"])
def test_four_kills_finish_in_place_with_spares_taken_back_into_megatrons_loop(tmp_path, failure_free,
                                                                                failure_free_evaluated, optimizer):
    proc, events = _resilient(tmp_path, *EVAL, *optimizer)
    check(proc)
    out = proc.stdout + proc.stderr
    assert len(read_events(events, "start")) == 8  # nothing restarted
    recoveries = [(a["iteration"], a["failed_launch_ranks"], a["taken_back_launch_ranks"], a["data_parallel_size"])
                  for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert recoveries == [(3, [7], [], 3), (4, [6], [3], 3), (5, [0], [], 2), (6, [5], [4], 2)], out[-4000:]
    assert "launch rank 3 enters Megatron's loop again at iteration 4" in out
    assert "launch rank 4 enters Megatron's loop again at iteration 6" in out
    assert not read_events(events, "fallback_checkpoint")
    if optimizer:  # parts only: the plans that took spares back move no weights and name the copies used
        taking = [p["executed"] for p in read_events(events, "plan") if p["executed"].get("filled")]
        assert len(taking) == 2 and all(p["part_sources"] and not p["transfers"] for p in taking), taking
    else:
        assert_moved_as_planned(events, at_least=2)  # each spare received exactly what its plan priced
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
    # Every evaluation on the re-formed worlds' rebuilt loaders: the periodic ones, and the validation
    # and test sets' as the job ends.
    evaluated = evaluated_losses(proc.stdout)
    assert sorted(evaluated) == sorted(failure_free_evaluated) and len(evaluated) == 6, proc.stdout[-3000:]
    for what, loss in failure_free_evaluated.items():
        assert evaluated[what] == pytest.approx(loss, rel=1e-5), (what, evaluated[what], loss)


def test_the_same_kills_end_in_a_checkpoint_restart_when_spares_leave(tmp_path):
    proc, events = _resilient(tmp_path, "--resihp-no-standby")
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    assert [a["data_parallel_size"] for a in read_events(events, "adapted") if "failed_ranks" in a] == [3, 2, 1]
    assert read_events(events, "fallback_checkpoint")


def test_a_stage_group_takes_a_stage_that_is_short_with_its_state(tmp_path, failure_free):
    # TP1 x PP2 x DP3 on 6 ranks: replicas (0 | 3), (1 | 4), (2 | 5). Ranks 1 and 2, both of stage 0,
    # killed together: replica 0 goes on, and of the stage-1 ranks 4 and 5 left over, one takes stage
    # 0, receiving its layers, embedding and Adam moments from rank 0, so DP goes 3 -> 2, not 1.
    events = tmp_path / "events.jsonl"
    proc = run_job(6, [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=1,at=4", "--resihp-inject=kill:rank=2,at=4"], timeout_s=600)
    check(proc)
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [(a["failed_launch_ranks"], a["data_parallel_size"]) for a in adapted] == [([1, 2], 2)], adapted
    assert_moved_as_planned(events, at_least=1)  # what the plan priced is what moved
    # The same global batch over 4 replicas (the reference) and over 3, then 2: equal to rounding,
    # which in the key biases (no true gradient) Adam makes 1.1e-6 (measured; elsewhere 4e-9).
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, key_bias_atol=5e-6)


# Per-token loss: each micro-batch's backward then starts from its loss sum, not from the loss over
# the micro-batches a replica runs, so its bf16 gradients round alike whatever the replica count.
BF16 = ["--bf16", "--calculate-per-token-loss"]


@pytest.fixture(scope="module")
def failure_free_bf16(tmp_path_factory):
    """Stock Megatron-LM in bf16 (bf16 weights, fp32 main copies in the optimizer), failure-free."""
    tmp = tmp_path_factory.mktemp("failure_free_bf16")
    args = [*_args(tmp, "ckpt"), *BF16]
    proc = run_job(8, args, timeout_s=420)
    check(proc)
    return training_of(proc, args), tmp / "ckpt"


def test_a_stage_taken_over_in_bf16_arrives_with_its_fp32_main_copies(tmp_path, failure_free_bf16):
    # The bf16 twin of the test above: the rank taking stage 0 receives its bf16 weights, the
    # optimizer's fp32 main copies of them and their Adam moments. Rebuilt from the bf16 weights
    # instead, the main copies would lose every update smaller than bf16's rounding (about 4e-3 of
    # a weight), and the saved main copies would differ by that much.
    events = tmp_path / "events.jsonl"
    proc = run_job(6, [*_args(tmp_path, "ckpt"), *BF16, "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=1,at=4", "--resihp-inject=kill:rank=2,at=4"], timeout_s=600)
    check(proc)
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [a["data_parallel_size"] for a in adapted] == [2], adapted
    stock_training, stock_root = failure_free_bf16
    assert_same_training(proc.stdout, tmp_path / "ckpt", stock_training, key_bias_atol=5e-6)
    ours, stock = (main_copies(saved_states(root)) for root in (tmp_path / "ckpt", stock_root))
    assert sorted(ours) == sorted(stock)
    for shard in stock:
        torch.testing.assert_close(ours[shard], stock[shard], rtol=0, atol=1e-6, msg=shard)


def test_a_spare_standing_by_when_the_jobs_store_dies_leaves_cleanly(tmp_path):
    # TP1 x PP2 x DP2, each rank its own process and the job's store another
    # (scripts/slurm/job_store.py, as under Slurm): launch rank 3 killed at iteration 2 leaves rank 1
    # standing by; then the store is SIGKILLed. The working ranks leave with exit 3 and the cause;
    # the spare, which holds nothing, with exit 0.
    events, port_file = tmp_path / "events.jsonl", tmp_path / "store.port"
    args = [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
            "--resihp-inject=kill:rank=3,at=2"]
    args[args.index("--train-iters") + 1] = "60"
    args[args.index("--save-interval") + 1] = "2"
    logs = [open(tmp_path / "store.log", "w")]
    store = subprocess.Popen([sys.executable, str(REPO / "scripts/slurm/job_store.py"), "--port-file", str(port_file)],
                             cwd=REPO, env=job_env(), stdout=logs[0], stderr=subprocess.STDOUT)
    sys.path.insert(0, str(REPO / "scripts"))  # scripts/ is not a package; launch_local imports its siblings
    from launch_local import rank_vars  # the variables every launcher gives a rank

    ranks = []
    try:
        wait_for(port_file.exists, 60, tmp_path / "store.log")
        port = int(port_file.read_text())
        for rank in range(4):
            logs.append(open(tmp_path / f"rank{rank}.log", "w"))
            ranks.append(subprocess.Popen(
                [sys.executable, "-u", str(REPO / "pretrain_gpt_resilient.py"), *args], cwd=REPO,
                env=job_env(rank_vars(rank, 4, "127.0.0.1", port)), stdout=logs[-1], stderr=subprocess.STDOUT))
        wait_for(lambda: any(r["iteration"] >= 4 for r in read_events(events, "iteration")), 300,
                  tmp_path / "rank0.log")
        store.kill()
        codes = [proc.wait(timeout=120) for proc in ranks]
    finally:
        for proc in [store, *ranks]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    output = "\n".join((tmp_path / f"rank{r}.log").read_text() for r in range(4))
    assert codes == [3, 0, 3, -9], output[-3000:]
    assert [e["launch_rank"] for e in read_events(events, "standby")] == [1], output[-3000:]
    assert "the job's store stopped answering while launch rank 1 stood by" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("phase", ["reform", "rendezvous"])
def test_a_rank_lost_while_the_survivors_reform_is_planned_around_again(tmp_path, failure_free, phase):
    # TP1 x PP2 x DP3: replicas (0 | 3), (1 | 4), (2 | 5). Rank 2 dies at 4; rank 1 dies as it is about
    # to join the re-formed world (reform), or once every member has said it is there and the process
    # group is forming (rendezvous), so that world never forms. The survivors name rank 1 through the
    # old world's heartbeats and plan again: replica 0 and a replica rebuilt of stage-1 rank 4 or 5
    # (the other standing by) taking stage 0 with its state finish the job.
    events = tmp_path / "events.jsonl"
    proc = run_job(6, [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=2,at=4", f"--resihp-inject=kill:rank=1,at=4,during={phase}"],
                   timeout_s=600)
    check(proc)
    output = proc.stdout + proc.stderr
    assert f"launch rank 1: injecting kill:rank=1,at=4,during={phase}" in output
    assert "re-forming world 1 failed" in output
    plans = read_events(events, "plan")
    assert [p["attempt"] for p in plans] == [1, 2], plans
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [a["data_parallel_size"] for a in adapted] == [2], adapted
    # The first plan's spare (rank 5) waited for that world to form, and plans again as a survivor.
    assert adapted[0]["failed_launch_ranks"] == [1, 2], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, key_bias_atol=5e-6)


def test_a_kept_rank_lost_as_the_world_forms_leaves_its_stage_to_the_spare_that_still_holds_it(tmp_path, failure_free):
    # TP1 x PP2 x DP2: replicas (0 | 2) and (1 | 3). Rank 2 dies at 4: replica 1 goes on and rank 0
    # is the plan's spare. Rank 1 dies as it is about to join that world, and then stage 0's state
    # is held by rank 0 alone. A spare leaves only once the world it is left out of has formed, so
    # rank 0 still holds it and plans again with rank 3: a replica rebuilt of rank 0's stage 0 and
    # rank 3's stage 1 finishes the job (before, rank 0 had left, and the job fell back to a
    # checkpoint).
    events = tmp_path / "events.jsonl"
    args = _args(tmp_path, "ckpt")
    proc = run_job(4, [*args, "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=2,at=4", "--resihp-inject=kill:rank=1,at=4,during=reform"],
                   timeout_s=600)
    check(proc)
    assert "launch rank 1: injecting kill:rank=1,at=4,during=reform" in proc.stdout + proc.stderr
    plans = read_events(events, "plan")
    assert [(p["attempt"], p["action"]) for p in plans] == [(1, "adapt"), (2, "adapt")], plans
    assert plans[0]["executed"]["spares"] == [0], plans[0]
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [(a["failed_launch_ranks"], a["world_size"]) for a in adapted] == [([1, 2], 2)], adapted
    assert not read_events(events, "standby"), "rank 0 stood by before the world it was left out of formed"
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, key_bias_atol=5e-6)


def test_a_receiver_lost_while_a_stage_moves_to_it_is_planned_around_again(tmp_path, failure_free):
    # Ranks 1 and 2 (stage 0) die at 4, and the stage-1 rank chosen to take stage 0 from rank 0 dies once
    # the moves' world has formed, before its state arrives. The moves only read the senders' state, so
    # the survivors plan again from what they hold and finish on replica 0 alone.
    events = tmp_path / "events.jsonl"
    proc = run_job(6, [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-inject=kill:rank=1,at=4", "--resihp-inject=kill:rank=2,at=4",
                       "--resihp-inject=kill:rank=4,at=4,during=moves",
                       "--resihp-inject=kill:rank=5,at=4,during=moves"], timeout_s=600)
    check(proc)
    output = proc.stdout + proc.stderr
    assert "injecting kill:rank=4,at=4,during=moves" in output or "injecting kill:rank=5,at=4,during=moves" in output
    plans = read_events(events, "plan")
    assert [p["attempt"] for p in plans] == [1, 2], plans
    adapted = [a for a in read_events(events, "adapted") if "failed_ranks" in a]
    assert [a["data_parallel_size"] for a in adapted] == [1], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, key_bias_atol=5e-6)


def test_a_sender_lost_while_its_stage_moves_ends_at_the_last_checkpoint(tmp_path):
    # Rank 0, the one holder of stage 0 left after ranks 1 and 2 died, dies while it is to send that
    # stage: no survivor holds it, so nothing is assembled and the job ends pointing at the checkpoint
    # --save-interval wrote, with the cause named and the command that resumes it.
    events, ckpt = tmp_path / "events.jsonl", tmp_path / "ckpt"
    args = [*_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
            "--resihp-inject=kill:rank=1,at=4", "--resihp-inject=kill:rank=2,at=4",
            "--resihp-inject=kill:rank=0,at=4,during=moves"]
    args[args.index("--save-interval") + 1] = "2"
    proc = run_job(6, args, timeout_s=600)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    fallback = read_events(events, "fallback_checkpoint")
    assert len(fallback) == 1 and "(0, 0)" in fallback[0]["reason"], fallback
    assert fallback[0]["resume_command"].endswith(f"--load {ckpt}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not [a for a in read_events(events, "adapted") if "failed_ranks" in a]
