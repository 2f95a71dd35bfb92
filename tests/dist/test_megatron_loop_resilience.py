"""Resilience on Megatron-LM's own training loop, 8 CPU ranks TP2 x PP2 x DP2.

A rank SIGKILLed mid-run is survived in place: the survivors re-form without it, Megatron's loop goes
on to its last iteration, and every logged loss and the saved weights equal a failure-free run of
stock Megatron-LM (no ``--resihp-*`` flag): killed in the step, while Megatron logs an iteration,
or while it saves a checkpoint. What the fail-stop path cannot carry yet is refused before
anything starts.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys

import pytest

from scripts.child_env import job_env
from scripts.signal_rank import run_and_signal
from tests.dist.launch import REPO, check, read_events, run_job
from tests.dist.megatron_jobs import (
    ITERATIONS, assert_same_losses, assert_same_training, job_args, logged_losses, replaced, resilient, stock_training,
    wait_for,
)

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    return stock_training(8, job_args(tmp_path_factory.mktemp("failure_free"), "ckpt"))


# In the step, or as Megatron logs the iteration: its log runs world-wide collectives (the interval
# timer's barrier, the timers' all-gather) after every rank's optimizer step; or, under
# --exit-duration-in-mins (as Megatron-LM's example scripts run), in the all-reduce after every step
# that asks whether any rank's time is up.
@pytest.mark.parametrize("kill,flags", [("kill:rank=5,at=4", []), ("kill:rank=5,at=4,during=log", []),
                                        ("kill:rank=5,at=4,during=exit-check", ["--exit-duration-in-mins", "1000"])],
                         ids=["in-step", "in-log", "in-exit-check"])
def test_a_sigkilled_rank_is_survived_in_place_with_the_failure_free_runs_losses_and_weights(tmp_path, failure_free,
                                                                                             kill, flags):
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), *flags, "--resihp-inject", kill], timeout_s=420)
    check(proc)  # the launcher reports a job that survived its failure as finished
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
    # The old world's groups went with the model that held them: no process finishes with more of
    # gloo's threads than it started with in the larger world.
    started = {e["pid"]: e["threads"] for e in read_events(events, "start")}
    finished = {e["pid"]: e["threads"] for e in read_events(events, "finish")}

    def held(threads: dict, kind: str) -> int:
        return sum(count for name, count in threads.items() if kind in name)

    assert len(finished) >= 4 and all(held(finished[pid], "gloo") <= held(started[pid], "gloo")
                                      for pid in finished), (started, finished)


def test_a_rank_killed_after_its_optimizer_step_leaves_that_iteration_done_and_the_data_where_it_was(
        tmp_path, failure_free):
    # Replica 1 steps; its last stage then fails in the loss's reduction with the dead rank, its first
    # stage later, in the log. Iteration 4 is done (its loss is not logged), and every stage's
    # loader goes on at iteration 5's samples: the first stage's tokens and the last stage's labels
    # come from the same batch (they did not: the last stage read iteration 4's labels again).
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--resihp-inject", "kill:rank=5,at=4,during=optimizer"],
                   timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=[1, 2, 3, 5, 6, 7, 8])


# The error is a RuntimeError that torch.distributed did not raise, as a device error or a bug on one
# rank would be. Raised in the backward pass, it strikes before any rank steps: iteration 4 is run
# again. Raised as rank 5's optimizer step begins, it finds the other replica stepping: iteration 4
# is done, its loss not logged. There, under torch_dist (whose saves let a recovery shrink TP), the
# planner could rebuild a replica from ranks 0 and 4, which did not step, beside the replica that
# did: the ranks an update behind stand aside instead of redoing iteration 4 against the others' 5.
@pytest.mark.parametrize("phase, iterations, flags", [
    ("backward", range(1, ITERATIONS + 1), {}),
    ("optimizer", [1, 2, 3, 5, 6, 7, 8], {}),
    ("optimizer", [1, 2, 3, 5, 6, 7, 8], {"--ckpt-format": "torch_dist"})],
    ids=["backward", "optimizer", "optimizer-torch-dist"])
def test_a_rank_that_raises_an_error_of_its_own_leaves_at_once_and_the_others_go_on_exact(tmp_path, failure_free,
                                                                                          phase, iterations, flags):
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*replaced(resilient(tmp_path, events), flags), "--resihp-inject",
                       f"raise:rank=5,at=4,during={phase}"], timeout_s=420)
    check(proc)  # a rank that left on its own error is a failed rank the job survived
    left = [e for e in read_events(events, "exit") if e["rank"] == 5]
    assert [(e["iteration"], e["exit_code"]) for e in left] == [(4, 4)], left
    assert f"injected raise:rank=5,at=4,during={phase}" in proc.stdout + proc.stderr  # its traceback
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    # It left at once: the others did not wait for a collective or hang timeout (30 and 60 s).
    inject = read_events(events, "inject")[0]
    assert adapted[0]["time"] - inject["time"] < 15, (inject, adapted)
    if not flags:
        assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=iterations)
        return
    # torch_dist's files do not compare with the torch-format reference's: the losses after the
    # recovery carry the weights' exactness.
    assert_same_losses(proc.stdout, failure_free, iterations)
    aside = sorted(int(r) for r in re.findall(r"launch rank (\d) did not step iteration 4", proc.stdout))
    assert aside == [0, 1, 4], proc.stdout[-3000:]


@pytest.mark.parametrize("phase", ["save", "save-write"])
def test_a_rank_killed_while_a_checkpoint_is_saved_is_survived_and_the_save_made_again_whole(tmp_path, failure_free,
                                                                                             phase):
    # As the save of iteration 4 begins, or once the rank's files are written and before the barrier
    # that waits for every rank's: the survivors go on after iteration 4 and save it again. The
    # tracker never named the interrupted save.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--save-interval", "2",
                       "--resihp-inject", f"kill:rank=5,at=4,during={phase}"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    assert "resihp: saving iteration 4 again, on the re-formed world" in proc.stdout
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
    if phase == "save-write":
        # The save made again is whole: stock Megatron-LM resumes from it and trains the rest exactly.
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
        resumed = run_job(8, [*job_args(tmp_path, "ckpt"), "--load", str(tmp_path / "ckpt")], timeout_s=420)
        check(resumed)
        assert_same_training(resumed.stdout, tmp_path / "ckpt", failure_free, iterations=range(5, ITERATIONS + 1))


def test_rank_0_killed_after_every_file_of_a_save_and_before_the_tracker_is_survived_and_the_tracker_written(
        tmp_path, failure_free):
    # Every rank's files of iteration 4 are written; rank 0, the one that writes Megatron's tracker,
    # dies before it does. Replica 1 goes on after iteration 4, and every later save is named.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--save-interval", "2",
                       "--resihp-inject", "kill:rank=0,at=4,during=save-tracker"], timeout_s=420)
    check(proc)
    assert [e["iteration"] for e in read_events(events, "inject")] == [4]
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [0])], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)


def test_a_rank_killed_as_the_evaluation_begins_costs_that_evaluation_only(tmp_path, failure_free):
    # Evaluation every 2 iterations: the one at iteration 4 is lost (every survivor skips its rest),
    # training goes on after iteration 4, and the evaluation at 6 runs on the re-formed world.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--eval-interval", "2", "--eval-iters", "1",
                       "--resihp-inject", "kill:rank=5,at=4,during=eval"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    assert "resihp: the evaluation at iteration 4 is lost to the failure; training goes on" in proc.stdout
    assert [i for i in (2, 4, 6, 8) if f"validation loss at iteration {i} " in proc.stdout] == [2, 6, 8], \
        proc.stdout[-3000:]
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


def test_a_rank_stopped_from_outside_is_named_hung_and_survived_in_place(tmp_path, failure_free):
    # Under a 900 s collective timeout only the beacon's view of the stopped process names it in time.
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--nproc-per-node=8",
           str(REPO / "pretrain_gpt_resilient.py"), *resilient(tmp_path, events),
           "--resihp-collective-timeout-s", "900"]
    code, output, sent_at = run_and_signal(cmd, events, rank=5, sig=signal.SIGSTOP, after_iteration=3, timeout_s=400)
    (tmp_path / "job.log").write_text(output)  # the whole job's output, for a failure read past its tail
    assert sent_at is not None and code == 0, output[-3000:]
    assert "sees launch ranks [5] hung ([5]: stopped by a signal)" in output, output[-3000:]
    adapted = read_events(events, "adapted")
    assert len(adapted) == 1 and adapted[0]["world_size"] == 4 and adapted[0]["failed_ranks"] == [5], adapted
    assert_same_training(output, tmp_path / "ckpt", failure_free)


def test_a_rank_hung_in_its_own_code_is_named_in_seconds_and_survived_in_place(tmp_path, failure_free):
    # A Python sleep before its step, under a 900 s collective timeout: the others wait for it in
    # their collectives, and what each rank's training thread is doing names it.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--resihp-collective-timeout-s", "900",
                       "--resihp-inject", "hang:rank=5,at=5"], timeout_s=400)
    check(proc)
    output = proc.stdout + proc.stderr
    verdicts = read_events(events, "verdict")
    assert verdicts and all(v["kind"] == "hang" and v["ranks"] == [5] for v in verdicts), verdicts
    assert max(v["time"] for v in verdicts) - read_events(events, "inject")[0]["time"] < 20.0, verdicts
    assert "([5]: working without progress for" in output, output[-3000:]
    adapted = read_events(events, "adapted")
    assert len(adapted) == 1 and adapted[0]["world_size"] == 4 and adapted[0]["failed_ranks"] == [5], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


def test_a_rank_killed_as_the_job_ends_leaves_it_finished(tmp_path, failure_free):
    # After the last iteration and its save, as pretrain() returns: nothing is left to survive, and
    # the job ends as a finished one (the launcher counts the killed rank as failed, not the job).
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--resihp-inject",
                       f"kill:rank=5,at={ITERATIONS},during=shutdown"], timeout_s=420)
    check(proc)
    assert "rank 5 exited with signal SIGKILL" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert [e["rank"] for e in read_events(events, "inject")] == [5] and not read_events(events, "adapted")
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


def test_when_the_jobs_store_dies_every_rank_leaves_with_the_cause_and_the_checkpoint_to_resume_from(tmp_path):
    # torchrun's agent hosts the job's store, and its ranks outlive it (scripts/launch_local.py's
    # die with it, by design). Without the store no failure can be named or survived: every rank
    # leaves within seconds with exit 3, naming the cause and the last periodic checkpoint, rather
    # than training on unprotected or dying in its next collective.
    events, log = tmp_path / "events.jsonl", tmp_path / "job.log"
    args = replaced(resilient(tmp_path, events), {"--tensor-model-parallel-size": "1", "--train-iters": "60"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(REPO / "pretrain_gpt_resilient.py"), *args, "--save-interval", "2"]
    with open(log, "w") as out:  # a file: the ranks write on after the agent is gone
        agent = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: any(r["iteration"] >= 3 for r in read_events(events, "iteration")), 300, log)
        finally:
            agent.kill()
            agent.wait()
    wait_for(lambda: len(read_events(events, "exit")) == 4, 120, log)
    output = log.read_text()
    exits = {e["rank"]: e["exit_code"] for e in read_events(events, "exit")}
    assert exits == {0: 3, 1: 3, 2: 3, 3: 3}, output[-3000:]
    lost = read_events(events, "store_lost")
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert len(lost) == 4 and {e["last_checkpoint"] for e in lost} == {saved} and saved >= 2, lost
    assert "stopped answering (the process or node that hosts it is gone)" in output, output[-3000:]
    assert "resume with: python scripts/launch_local.py --nproc-per-node 4" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_with_no_replica_left_whole_the_job_resumes_from_megatrons_checkpoint_by_the_printed_command(
        tmp_path, failure_free):
    # The first kill leaves one replica; the second breaks it. The survivors point to the last
    # periodic checkpoint (written by the re-formed world, in Megatron's format) and exit 3.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--save-interval", "2", "--resihp-inject", "kill:rank=5,at=4",
                       "--resihp-inject", "kill:rank=2,at=6"], timeout_s=420)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    fallback = read_events(events, "fallback_checkpoint")
    assert len(fallback) == 1 and fallback[0]["path"].endswith("iter_0000004"), fallback
    resume = shlex.split(fallback[0]["resume_command"])
    assert resume[:2] == ["python", "scripts/launch_local.py"] and "--resihp-inject" not in resume, resume
    resumed = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=job_env(), capture_output=True, text=True,
                             timeout=420)
    check(resumed)
    assert_same_training(resumed.stdout, tmp_path / "ckpt", failure_free, iterations=range(5, ITERATIONS + 1))


def test_a_rank_lost_while_megatron_sets_the_job_up_ends_it_at_once_with_the_command_to_run_it_again(
        tmp_path, failure_free):
    # Killed as Megatron builds the data loaders, before the first step: the heartbeats, on since the
    # groups were formed, name it; the others leave at once (exit 3) with no traceback, and the
    # printed command trains the whole job as stock Megatron-LM does.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--resihp-inject", "kill:rank=5,at=1,during=setup"],
                   timeout_s=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3, output[-3000:]
    assert "Traceback" not in output and not logged_losses(proc.stdout), output[-3000:]
    failed = read_events(events, "start_failed")
    assert failed and {e["rank"] for e in failed} <= set(range(8)) - {5}, failed
    assert all(e["failed_ranks"] == [5] for e in failed), failed
    assert "failed while Megatron set the job up, before the first iteration" in output, output[-3000:]
    again = shlex.split(failed[0]["resume_command"])
    assert again[:2] == ["python", "scripts/launch_local.py"] and "--resihp-inject" not in again, again
    rerun = subprocess.run([sys.executable, *again[1:]], cwd=REPO, env=job_env(), capture_output=True, text=True,
                           timeout=420)
    check(rerun)
    assert_same_training(rerun.stdout, tmp_path / "ckpt", failure_free)


# Each rank's part of the distributed optimizer's state is copied on the next rank of its position
# after every update: the kept replica receives the dead replica's parts (rank 5's from its copy on
# rank 7) and splits the state anew over DP 1. Killed in the step, it is redone; killed once its
# optimizer step returned (the parts updated and copied), it is done. With sequence parallelism too.
@pytest.mark.parametrize("kill, extra, iterations", [
    ("kill:rank=5,at=4", [], range(1, ITERATIONS + 1)),
    ("kill:rank=5,at=4,during=optimizer", ["--sequence-parallel"], [1, 2, 3, 5, 6, 7, 8]),
], ids=["in-step", "after-its-update-sequence-parallel"])
def test_with_the_distributed_optimizer_a_dead_ranks_part_comes_from_its_copy_and_training_goes_on_exact(
        tmp_path, failure_free, kill, extra, iterations):
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--use-distributed-optimizer", *extra,
                       "--resihp-inject", kill], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    plans = read_events(events, "plan")
    assert plans and plans[-1]["executed"]["part_sources"] == {"5": 7}, plans
    assert not read_events(events, "fallback_checkpoint")
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=iterations)


def test_a_rank_killed_between_its_update_and_its_copies_is_survived_in_place_by_going_back_one_update(
        tmp_path, failure_free):
    # Rank 5 dies once its part is updated, before the update's copy reaches rank 7: the survivors'
    # parts are of update 4, the copy of rank 5's of update 3. Every survivor takes back its part as
    # it was before its update (kept while the step runs), and iteration 4 runs again on DP 1.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--use-distributed-optimizer",
                       "--resihp-inject", "kill:rank=5,at=4,during=update"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 4, [5])], adapted
    assert not read_events(events, "fallback_checkpoint")
    assert "the optimizer's parts went back to update 3, where every part stood; iteration 4 runs again" in proc.stdout
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


def test_with_the_distributed_optimizer_a_rank_lost_while_the_parts_move_is_planned_around_in_seconds(
        tmp_path, failure_free):
    # Rank 5 dies at 4; rank 4, a member of the world the dead replica's optimizer parts move in,
    # dies there. The member that meets the failure shuts its connections of that world, so the
    # members blocked on it leave at once instead of waiting out the collective timeout (30 s), and
    # plan again: replica 0 finishes alone, exact.
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), "--use-distributed-optimizer",
                       "--resihp-inject", "kill:rank=5,at=4", "--resihp-inject", "kill:rank=4,at=4,during=moves"],
                   timeout_s=420)
    check(proc)
    moves_kill = [e for e in read_events(events, "inject") if "during=moves" in e["fault"]]
    adapted = read_events(events, "adapted")
    assert len(moves_kill) == 1 and [(a["iteration"], a["world_size"]) for a in adapted] == [(4, 4)], adapted
    assert {4, 5} <= set(adapted[0]["failed_launch_ranks"]), adapted
    assert adapted[0]["time"] - moves_kill[0]["time"] < 15, (moves_kill, adapted)
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


def test_a_launch_that_places_layers_unevenly_is_survived_in_place_on_its_own_split(tmp_path):
    # Megatron-LM's example scripts may give a stage fewer layers (--decoder-first-pipeline-num-layers,
    # a --pipeline-model-parallel-layout): the survivors rebuild that split, and every loss and weight
    # equals stock Megatron-LM's run with the same flags.
    uneven = ["--decoder-first-pipeline-num-layers", "1"]
    stock = stock_training(8, [*job_args(tmp_path, "stock"), *uneven])
    events = tmp_path / "events.jsonl"
    proc = run_job(8, [*resilient(tmp_path, events), *uneven, "--resihp-inject", "kill:rank=5,at=4"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["layers_per_replica"]) for a in adapted] == [(4, 4, [[1, 3]])], adapted
    assert_same_training(proc.stdout, tmp_path / "ckpt", stock)


def test_what_the_fail_stop_path_cannot_carry_is_refused_before_anything_starts(tmp_path):
    # One launch with three such flags: one message (from one rank) names each, exit 2, nothing written.
    proc = run_job(8, [*job_args(tmp_path, "ckpt"), "--resihp-enable",
                       "--resihp-device-memory-gb", "40",
                       "--context-parallel-size", "2", "--resihp-inject", "kill:rank=1,at=3,during=save-rename"],
                   timeout_s=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1, proc.stderr[-2000:]
    for named in ("--resihp-device-memory-gb (it sizes", "--context-parallel-size",
                  "during=save-rename"):
        assert named in proc.stderr, (named, proc.stderr[-2000:])
    assert not (tmp_path / "ckpt").exists()
