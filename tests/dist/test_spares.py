"""Spares stand by and are taken back at a later failure: real processes, real SIGKILLs.

TP2 x PP2 x DP2 on 8 processes, launch rank = TP rank + 2 * replica + 4 * stage. Each fail-stop
plan leaves some healthy ranks out; they stand by instead of exiting, and the next recovery gives
them the places of ranks that died, their state sent by live holders. The job then survives a
sequence of kills that, with spares exiting, ends at its third kill with a shard that no live
rank holds. Parameters, losses and consumed samples after 8 iterations equal a failure-free run's.
"""

import pytest

from tests.dist.launch import assert_moved_as_planned, check, decisions, iteration_losses, read_events, run_job
from tests.dist.own_loop_jobs import MODEL, RESILIENT, assert_same_training

RUN = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "8"]
SHAPE = [*RUN, "--tensor-model-parallel-size", "2"]
# The jobs end on TP-1 replicas, so their checkpoints hold TP-1 shards: the reference runs TP 1 x
# PP 2. Their first iterations ran at TP 2, whose row-parallel reductions sum in another order, and
# Adam turns such rounding in near-zero gradients into update differences of its own (up to
# 1.6e-5 measured in test_fail_stop.py's TP-shrink case): parameters are compared to 5e-5.
PARAM_TOL = 5e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TP1 x PP2, failure-free, 8 iterations of global batch 16."""
    tmp = tmp_path_factory.mktemp("reference")
    log = tmp / "events.jsonl"
    check(run_job(2, [*MODEL, *RUN, "--save", str(tmp / "ckpt"), "--resihp-event-log", str(log)]))
    return tmp / "ckpt", iteration_losses(log)


def _run(tmp_path, kills, extra=()):
    log = tmp_path / "events.jsonl"
    proc = run_job(8, [*MODEL, *RESILIENT, *SHAPE, *extra, "--save", str(tmp_path / "ckpt"),
                       "--resihp-event-log", str(log),
                       *(f"--resihp-inject=kill:rank={r},at={at}" for r, at in kills)], launcher="local")
    return proc, log


def _recoveries(log):
    """(iteration, launch ranks taken back) of every fail-stop recovery, in order."""
    return [(a["iteration"], a["taken_back_launch_ranks"]) for a in read_events(log, "adapted") if "failed_ranks" in a]


def test_three_kills_finish_in_place_with_the_spares_taken_back(tmp_path, reference):
    # Kill 7: replica 0 goes on whole, ranks 2 and 6 run a TP-1 replica, rank 3 is a spare and
    # stands by. Kill 2: rank 3 takes its place, receiving stage 0's state from ranks 0 and 1.
    # Kill 4: replica (3 | 6) goes on whole; with spares exiting, rank 6 would have left at the
    # second kill, and the TP half of stage 1 that rank 4 held would have had no live holder.
    proc, log = _run(tmp_path, [(7, 3), (2, 5), (4, 7)])
    check(proc)
    out = proc.stdout + proc.stderr
    assert len(read_events(log, "start")) == 8  # nothing restarted
    assert "launch rank 3 is a spare after the adaptation" in out and "launch rank 3 stands by" in out, decisions(log)
    assert [(e["rank"], e["iteration"]) for e in read_events(log, "standby")][:1] == [(3, 3)], decisions(log)
    recoveries = _recoveries(log)
    assert [it for it, _ in recoveries] == [3, 5, 7], decisions(log)
    assert recoveries[1][1] == [3], decisions(log)
    assert "launch rank 3 was taken back as world rank" in out
    assert not read_events(log, "fallback_checkpoint")
    # What each recovery moved is what its plan carried (the spare's state included).
    assert_moved_as_planned(log, at_least=2)
    assert_same_training(log, tmp_path / "ckpt", reference, 16, param_tol=PARAM_TOL)


def test_five_kills_finish_in_place_on_the_last_ranks_that_hold_every_shard(tmp_path, reference):
    # Kills of launch ranks 7, 2, 4, 6 and 0, one per iteration from 3. Spare 3 (left out at the
    # first) takes 2's place. At 4's death replica (3 | 6) goes on whole, ranks 0 and 5 run a TP-1
    # replica (5 receiving the TP half of stage 1 it lacks from 6) and rank 1 is a spare, which
    # takes 6's place at the next kill. At 0's death replica (3 | 1) goes on alone and rank 5
    # stands by. Launch ranks 1, 3 and 5 are left; each kill found a live holder of every shard.
    proc, log = _run(tmp_path, [(7, 3), (2, 4), (4, 5), (6, 6), (0, 7)])
    check(proc)
    assert _recoveries(log) == [(3, []), (4, [3]), (5, []), (6, [1]), (7, [])], decisions(log)
    assert not read_events(log, "fallback_checkpoint")
    # The one rank left standing by leaves as the job ends.
    assert [(e["rank"], e["exit_code"]) for e in read_events(log, "exit")] == [(5, 0)], decisions(log)
    assert_moved_as_planned(log, at_least=4)
    assert_same_training(log, tmp_path / "ckpt", reference, 16, param_tol=PARAM_TOL)


def test_without_standby_the_third_kill_ends_the_job_with_no_holder_of_a_shard(tmp_path):
    # The same three kills with spares exiting: the third finds no live holder of stage 1's TP
    # half 0, and nothing was saved to resume from.
    proc, log = _run(tmp_path, [(7, 3), (2, 5), (4, 7)], extra=["--resihp-no-standby"])
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not read_events(log, "standby")
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1 and "no survivor holds stage/TP shards [(1, 0)]" in fallback[0]["reason"], \
        decisions(log)
