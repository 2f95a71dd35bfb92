"""Fail-stop survived in place: real processes, a real SIGKILL, the launcher that keeps survivors.

The reference is a failure-free run of the same model fed the same global batches; per-token loss
makes the gradient independent of how micro-batches are spread over replicas, so parameters
after recovery must equal the reference's.
"""

import shlex
import signal
import subprocess
import sys

import pytest
import torch

from tests.dist.launch import REPO, assert_moved_as_planned, check, iteration_losses, main_copies, read_events, run_job
from tests.dist.own_loop_jobs import MODEL, RESILIENT, assert_same_params, assert_same_training, saved_params
from scripts.child_env import job_env
from scripts.signal_rank import run_and_signal

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TP2 x PP2, failure-free, 8 iterations of global batch 16."""
    tmp = tmp_path_factory.mktemp("reference")
    log = tmp / "events.jsonl"
    check(run_job(4, [*MODEL, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--global-batch-size", "16", "--train-iters", "8", "--save", str(tmp / "ckpt"),
                      "--resihp-event-log", str(log)]))
    return tmp / "ckpt", iteration_losses(log)


PP2_SHAPE = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "12", "--train-iters", "8"]


@pytest.fixture(scope="module")
def pp2_reference(tmp_path_factory):
    """TP1 x PP2, failure-free, 8 iterations of global batch 12 (the DP3 tests' reference)."""
    tmp = tmp_path_factory.mktemp("pp2_reference")
    log = tmp / "events.jsonl"
    check(run_job(2, [*MODEL, *PP2_SHAPE, "--resihp-event-log", str(log), "--save", str(tmp / "ckpt")]))
    return tmp / "ckpt", iteration_losses(log)


def _run_tp2pp2dp2(tmp_path, fault: str, resilient=tuple(RESILIENT)):
    """The reference's job on 8 ranks (DP2) with one fault injected, under the local launcher."""
    log = tmp_path / "events.jsonl"
    proc = run_job(8, [*MODEL, *resilient, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--global-batch-size", "16", "--train-iters", "8", "--save", str(tmp_path / "ckpt"),
                       "--resihp-event-log", str(log), "--resihp-inject", fault], launcher="local")
    check(proc)
    return proc, log


def test_sigkill_is_survived_in_place_with_exact_parameters(tmp_path, reference):
    # A collective timeout far beyond the test's own (300 s): survivors blocked with the dead rank
    # must leave their collectives when it is named, not when they time out.
    proc, log = _run_tp2pp2dp2(tmp_path, "kill:rank=5,at=4", ("--resihp-enable", "--resihp-collective-timeout-s", "900"))
    assert "rank 5 exited with signal SIGKILL" in proc.stdout + proc.stderr
    abandoned = {r for r in range(8) if f"resihp: launch rank {r} abandons world 0's collectives" in proc.stdout + proc.stderr}
    assert abandoned == {0, 1, 2, 3, 4, 6, 7}
    # Every survivor names the dead rank within 2 s of the kill.
    killed_at = read_events(log, "inject")[0]["time"]
    first_seen = {}
    for v in read_events(log, "verdict"):
        if v["kind"] == "dead" and v["ranks"] == [5]:
            first_seen.setdefault(v["rank"], v["time"] - killed_at)
    assert sorted(first_seen) == [0, 1, 2, 3, 4, 6, 7]
    assert max(first_seen.values()) < 2.0
    # Replica 1 goes on whole. With the cost model fitted to this job (compute dwarfs the gradient
    # sync of so small a model), ranks 0 and 4 of the broken replica also go on, at TP 1, each
    # receiving the TP half it lacks; rank 1 is a spare. The batch is split by speed.
    executed = read_events(log, "plan")[-1]["executed"]
    assert executed["kept_replicas"] == [1]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[0], [4]]]
    assert executed["quotas"][0] > executed["quotas"][1] >= 1 and sum(executed["quotas"]) == 8
    assert "launch rank 1 is a spare" in proc.stdout + proc.stderr
    adapted = read_events(log, "adapted")
    assert len(adapted) == 1 and adapted[0]["iteration"] == 4 and adapted[0]["world_size"] == 6
    assert adapted[0]["data_parallel_size"] == 2
    # Same iterations, same losses, same parameters, exact consumed samples.
    assert sorted(iteration_losses(log)) == list(range(1, 9))
    assert_same_training(log, tmp_path / "ckpt", reference, 16)


def test_hung_rank_is_named_fenced_and_survived_in_place(tmp_path, reference):
    # Stuck in its own code (a Python sleep) while the others wait for it in their collectives,
    # which would time out only after 900 s: the rank is named from what each rank's training
    # thread is doing (megatron/resihp/hang_rules.py), in seconds.
    ref_ckpt, ref_losses = reference
    proc, log = _run_tp2pp2dp2(tmp_path, "hang:rank=5,at=4", ("--resihp-enable", "--resihp-collective-timeout-s", "900"))
    output = proc.stdout + proc.stderr
    # Alive but stuck: named hung (never dead), left behind, and it fences itself.
    verdicts = read_events(log, "verdict")
    assert {v["kind"] for v in verdicts} == {"hang"}, verdicts
    assert all(v["ranks"] == [5] for v in verdicts), verdicts
    hung_at = read_events(log, "inject")[0]["time"]
    assert max(v["time"] for v in verdicts) - hung_at < 20.0, verdicts
    assert "working without progress for" in output, output[-3000:]
    # Its beacon fences it (the rank's own watchdog would too, if it got there first).
    assert ("heartbeat: beacon fences pid" in output
            or "launch rank 5 was left behind by the other ranks (judged hung); exiting" in output), output[-3000:]
    assert "rank 5 exited with signal SIGKILL" in output
    adapted = read_events(log, "adapted")
    assert len(adapted) == 1 and adapted[0]["world_size"] == 6 and adapted[0]["failed_ranks"] == [5]
    losses = iteration_losses(log)
    assert [losses[i] for i in range(1, 9)] == pytest.approx([ref_losses[i] for i in range(1, 9)], rel=1e-5)
    assert_same_params(saved_params(ref_ckpt, 8), saved_params(tmp_path / "ckpt", 8))


def test_second_failure_after_an_adaptation_is_survived(tmp_path, pp2_reference):
    # TP1 x PP2 x DP3: rank = replica + 3 * stage. Rank 1 (replica 1) dies at 4, rank 5 (replica 2)
    # right after the first adaptation, at 6. Rank 4, the spare of the first, stands by and takes
    # rank 5's place at the second (stage 1's state sent by rank 3): the job ends on two replicas.
    log = tmp_path / "events.jsonl"
    check(run_job(6, [*MODEL, *RESILIENT, *PP2_SHAPE, "--resihp-event-log", str(log),
                      "--resihp-inject", "kill:rank=1,at=4", "--resihp-inject", "kill:rank=5,at=6"], launcher="local"))
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["taken_back_launch_ranks"]) for a in adapted] == [(4, 4, []),
                                                                                                  (6, 4, [4])]
    losses, ref = iteration_losses(log), pp2_reference[1]
    assert [losses[i] for i in range(1, 9)] == pytest.approx([ref[i] for i in range(1, 9)], rel=1e-5)


def test_broken_replicas_are_rebuilt_in_place_with_exact_parameters(tmp_path, reference):
    log = tmp_path / "events.jsonl"
    # Rank 2 (replica 1, stage 0) and rank 5 (replica 0, stage 1) die: no replica is whole, but
    # replica 0's stage 0 (ranks 0, 1) and replica 1's stage 1 (ranks 6, 7) form one. Devices of
    # 4 MiB hold stage 0 only at TP 2 (5.3 MiB at TP 1), so ranks 3 and 4 cannot form a TP-1
    # replica and become spares.
    proc = run_job(8, [*MODEL, *RESILIENT, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--global-batch-size", "16", "--train-iters", "8", "--save", str(tmp_path / "ckpt"),
                       "--resihp-device-memory-gb", "0.004",
                       "--resihp-event-log", str(log), "--resihp-inject", "kill:rank=2,at=4",
                       "--resihp-inject", "kill:rank=5,at=4"], launcher="local")
    check(proc)
    plans = read_events(log, "plan")
    assert plans and plans[-1]["action"] == "adapt", plans
    executed = plans[-1]["executed"]
    rebuilt = [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]]
    assert executed["kept_replicas"] == [] and rebuilt == [[[0, 1], [6, 7]]]
    assert "launch rank 3 is a spare" in proc.stdout + proc.stderr and "launch rank 4 is a spare" in proc.stdout + proc.stderr
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"]) for a in adapted] == [(4, 4)], adapted
    assert not read_events(log, "fallback_checkpoint")
    assert_same_training(log, tmp_path / "ckpt", reference, 16)


def test_intact_stage_group_takes_a_lost_stage_and_receives_its_state(tmp_path, pp2_reference):
    # TP1 x PP2 x DP3: rank = replica + 3 * stage. Ranks 1 and 2 (stage 0 of replicas 1 and 2) die;
    # rank 4 takes stage 0, its layers and Adam moments sent by replica 0's rank 0, and pairs with
    # rank 5: DP 3 -> 2 instead of 1.
    log = tmp_path / "events.jsonl"
    check(run_job(6, [*MODEL, *RESILIENT, *PP2_SHAPE, "--resihp-event-log", str(log), "--save", str(tmp_path / "ckpt"),
                      "--resihp-inject", "kill:rank=1,at=4", "--resihp-inject", "kill:rank=2,at=4"], launcher="local"))
    executed = read_events(log, "plan")[-1]["executed"]
    assert executed["kept_replicas"] == [0]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[4], [5]]]
    assert_moved_as_planned(log)  # rank 0 sent rank 4 exactly the transfers the plan carried
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["data_parallel_size"]) for a in adapted] == [(4, 4, 2)], adapted
    assert_same_training(log, tmp_path / "ckpt", pp2_reference, 12)


@pytest.fixture(scope="module")
def pp2_reference_bf16(tmp_path_factory):
    """``pp2_reference`` in bf16: bf16 weights, fp32 main copies in the optimizer."""
    tmp = tmp_path_factory.mktemp("pp2_reference_bf16")
    log = tmp / "events.jsonl"
    check(run_job(2, [*MODEL, *PP2_SHAPE, "--bf16", "--resihp-event-log", str(log), "--save", str(tmp / "ckpt")]))
    return tmp / "ckpt", iteration_losses(log)


def test_a_lost_stage_taken_over_in_bf16_keeps_the_fp32_main_copies(tmp_path, pp2_reference_bf16):
    # The bf16 twin of the test above: rank 4 receives stage 0's bf16 weights, the optimizer's fp32
    # main copies of them and their Adam moments. Rebuilt from the bf16 weights instead, the main
    # copies would lose every update smaller than bf16's rounding (about 4e-3 of a weight).
    log = tmp_path / "events.jsonl"
    check(run_job(6, [*MODEL, *RESILIENT, *PP2_SHAPE, "--bf16", "--resihp-event-log", str(log),
                      "--save", str(tmp_path / "ckpt"),
                      "--resihp-inject", "kill:rank=1,at=4", "--resihp-inject", "kill:rank=2,at=4"], launcher="local"))
    executed = read_events(log, "plan")[-1]["executed"]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[4], [5]]]
    assert [(a["iteration"], a["data_parallel_size"]) for a in read_events(log, "adapted")] == [(4, 2)]
    ref_ckpt, ref_losses = pp2_reference_bf16
    losses = iteration_losses(log)
    assert [losses[i] for i in range(1, 9)] == pytest.approx([ref_losses[i] for i in range(1, 9)], rel=1e-5)
    ours, ref = saved_params(tmp_path / "ckpt", 8), saved_params(ref_ckpt, 8)
    assert_same_params(ref, ours)
    ours_main, ref_main = main_copies(ours), main_copies(ref)
    for shard in ref_main:
        torch.testing.assert_close(ours_main[shard], ref_main[shard], rtol=0, atol=1e-6, msg=shard)


def test_no_in_place_plan_saves_from_survivors_and_resumes(tmp_path, reference):
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "events.jsonl"
    args = [*MODEL, *RESILIENT, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "16", "--train-iters", "8", "--save", str(ckpt), "--resihp-event-log", str(log)]
    # Ranks 1, 2 and 6 leave one stage group whole (ranks 4, 5). Devices of 4 MiB hold stage 0
    # only at TP 2 (it takes 5.3 MiB at TP 1), so no replica can go on; but every (stage, TP)
    # shard survives (stage 0 in ranks 0 and 3), so a checkpoint is assembled from survivors.
    proc = run_job(8, [*args, "--resihp-device-memory-gb", "0.004",
                       *(f"--resihp-inject=kill:rank={r},at=4" for r in (1, 2, 6))], launcher="local")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1
    assert "no data-parallel replica whole" in fallback[0]["reason"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not list(ckpt.glob("*.tmp"))
    resume = fallback[0]["resume_command"]
    assert "--resihp-inject" not in resume and resume.endswith(f"--load {ckpt}")
    resumed_log = tmp_path / "resumed.jsonl"
    cmd = shlex.split(resume.replace(str(log), str(resumed_log)))
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=job_env())
    check(done)
    resumed = iteration_losses(resumed_log)
    assert sorted(resumed) == list(range(4, 9))
    assert [resumed[i] for i in range(4, 9)] == pytest.approx([ref_losses[i] for i in range(4, 9)], rel=1e-5)
    assert_same_params(saved_params(ref_ckpt, 8), saved_params(ckpt, 8))


def test_every_holder_of_a_shard_dead_points_to_the_last_periodic_checkpoint(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "events.jsonl"
    # Ranks 1 and 3 are the only holders of stage 0's TP shard 1: nothing can be assembled, so the
    # resume point is the last checkpoint --save-interval wrote (iteration 2).
    proc = run_job(8, [*MODEL, *RESILIENT, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--global-batch-size", "16", "--train-iters", "8", "--save", str(ckpt), "--save-interval", "2",
                       "--resihp-event-log", str(log), "--resihp-inject", "kill:rank=1,at=4",
                       "--resihp-inject", "kill:rank=3,at=4"], launcher="local")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1, fallback
    reason = fallback[0]["reason"]
    assert "no survivor holds stage/TP shards [(0, 1)]" in reason and "iteration 3 is trained again" in reason
    assert fallback[0]["path"] == str(ckpt / "iter_0000002")
    assert fallback[0]["resume_command"].endswith(f"--load {ckpt}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not list(ckpt.glob("*.tmp"))


@pytest.mark.parametrize("phase", ["reform", "rendezvous"])
def test_failure_while_the_survivors_reform_is_survived(tmp_path, pp2_reference, phase):
    # TP1 x PP2 x DP3: rank = replica + 3 * stage. Rank 2 (replica 2) dies at 4; rank 1 (replica 1)
    # dies as it is about to join the re-formed world (reform), or once every member has said it
    # is there and the process group is forming (rendezvous), so that world never forms. The
    # survivors name rank 1 through the old world's heartbeats and plan again: rank 5, the first
    # plan's spare, stands by and takes rank 1's place, so the job finishes on replicas 0 and 1.
    log = tmp_path / "events.jsonl"
    proc = run_job(6, [*MODEL, *RESILIENT, *PP2_SHAPE, "--resihp-event-log", str(log), "--resihp-inject",
                       "kill:rank=2,at=4", "--resihp-inject", f"kill:rank=1,at=4,during={phase}"], launcher="local")
    check(proc)
    output = proc.stdout + proc.stderr
    assert f"launch rank 1: injecting kill:rank=1,at=4,during={phase}" in output
    assert "re-forming world 1 failed" in output
    plans = read_events(log, "plan")
    assert [(p["attempt"], sorted(p["executed"]["new_rank"]), p["taken_back_launch_ranks"]) for p in plans] == [
        (1, ["0", "1", "3", "4"], []), (2, ["0", "3", "4", "6"], [5])], plans  # 6: the spare, after the world's ranks
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"]) for a in adapted] == [(4, 4)], adapted
    assert {1, 2} <= set(adapted[0]["failed_ranks"]) <= {1, 2, 5}  # 5: the first plan's spare, standing by then
    losses, ref = iteration_losses(log), pp2_reference[1]
    assert [losses[i] for i in range(1, 9)] == pytest.approx([ref[i] for i in range(1, 9)], rel=1e-5)


def test_receiver_killed_while_state_moves_to_a_lost_stage_is_survived(tmp_path, pp2_reference):
    # As in the intact-stage-group case, ranks 1 and 2 die and rank 4 is to take stage 0 from
    # rank 0; rank 4 dies once the moves' world has formed, before its state arrives. The moves
    # only read the senders' state, so the survivors plan again from what they hold and finish
    # on replica 0 (ranks 0, 3) with the reference's parameters; rank 5 is left alone at stage 1.
    log = tmp_path / "events.jsonl"
    proc = run_job(6, [*MODEL, *RESILIENT, *PP2_SHAPE, "--resihp-event-log", str(log), "--save", str(tmp_path / "ckpt"),
                       *(f"--resihp-inject=kill:rank={r},at=4" for r in (1, 2)),
                       "--resihp-inject", "kill:rank=4,at=4,during=moves"], launcher="local")
    check(proc)
    output = proc.stdout + proc.stderr
    assert "launch rank 4: injecting kill:rank=4,at=4,during=moves" in output, output[-3000:]
    plans = read_events(log, "plan")
    assert [(p["attempt"], sorted(p["executed"]["new_rank"])) for p in plans] == [
        (1, ["0", "3", "4", "5"]), (2, ["0", "3"])], plans
    assert plans[-1]["executed"]["spares"] == [5]
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 2, [1, 2, 4])], adapted
    assert_same_training(log, tmp_path / "ckpt", pp2_reference, 12)


def test_sender_killed_while_state_moves_ends_at_the_last_periodic_checkpoint(tmp_path):
    # Rank 0, the one holder of stage 0 left after ranks 1 and 2 died, dies while it is to send
    # that stage to rank 4: no survivor holds stage 0, so nothing is assembled and the job ends
    # pointing at the checkpoint --save-interval wrote, with the cause named.
    ckpt, log = tmp_path / "ckpt", tmp_path / "events.jsonl"
    proc = run_job(6, [*MODEL, *RESILIENT, "--pipeline-model-parallel-size", "2", "--global-batch-size", "12",
                       "--train-iters", "8", "--save", str(ckpt), "--save-interval", "2", "--resihp-event-log", str(log),
                       *(f"--resihp-inject=kill:rank={r},at=4" for r in (1, 2)),
                       "--resihp-inject", "kill:rank=0,at=4,during=moves"], launcher="local")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    plans = read_events(log, "plan")
    assert [(p["attempt"], p["action"]) for p in plans] == [(1, "adapt"), (2, "checkpoint-restart")], plans
    fallback = read_events(log, "fallback_checkpoint")
    assert len(fallback) == 1, fallback
    assert "no survivor holds stage/TP shards [(0, 0)]" in fallback[0]["reason"]
    assert fallback[0]["path"] == str(ckpt / "iter_0000002")
    assert fallback[0]["resume_command"].endswith(f"--load {ckpt}")
    assert not read_events(log, "adapted")
    assert not list(ckpt.glob("*.tmp"))


def test_tp_group_that_lost_a_rank_goes_on_at_a_smaller_tp_degree(tmp_path):
    # TP2 x DP2: replica 0 is ranks 0, 1 and replica 1 ranks 2, 3. Ranks 0 and 3 die, so neither
    # TP group is whole. Ranks 1 and 2 each run the whole model at TP 1 (DP 2), each keeping its
    # own half of every TP-split tensor and receiving the other half from the other.
    shape = ["--global-batch-size", "16", "--train-iters", "8"]
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(1, [*MODEL, *shape, "--resihp-event-log", str(ref_log), "--save", str(tmp_path / "ref")]))
    proc = run_job(4, [*MODEL, *RESILIENT, *shape, "--tensor-model-parallel-size", "2", "--resihp-event-log", str(log),
                       "--save", str(tmp_path / "ckpt"), *(f"--resihp-inject=kill:rank={r},at=4" for r in (0, 3))],
                   launcher="local")
    check(proc)
    assert "is a spare" not in proc.stdout + proc.stderr
    executed = read_events(log, "plan")[-1]["executed"]
    assert [[(s["ranks"], s["num_layers"]) for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [
        [([1], 4)], [([2], 4)]]
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, 2, [0, 3])], adapted
    # The reference runs TP1 throughout; this job's first 3 iterations ran at TP2, whose row-parallel
    # reductions sum in another order, and Adam turns such rounding in near-zero gradients into
    # update differences of its own: on an AVX-512 host one fc1 weight ends 1.6e-5 away (the next
    # largest 3.5e-6), so this comparison allows 5e-5.
    assert_same_training(log, tmp_path / "ckpt", (tmp_path / "ref", iteration_losses(ref_log)), 16,
                          param_tol=5e-5)


def test_a_tp_group_that_lost_a_rank_is_split_over_two_smaller_replicas(tmp_path):
    # TP4 x DP2: replica 0 is ranks 0-3, replica 1 ranks 4-7. Rank 0 dies. Replica 1 goes on
    # whole; of the three live ranks of replica 0, ranks 1 and 2 run the model at TP 2 and rank 3
    # at TP 1, so no survivor idles. Three replicas at three TP degrees, the batch split by speed,
    # and training stays exact.
    shape = ["--global-batch-size", "16", "--train-iters", "8", "--tensor-model-parallel-size", "4"]
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "events.jsonl"
    check(run_job(4, [*MODEL, *shape, "--resihp-event-log", str(ref_log), "--save", str(tmp_path / "ref")]))
    proc = run_job(8, [*MODEL, *RESILIENT, *shape, "--resihp-event-log", str(log), "--save", str(tmp_path / "ckpt"),
                       "--resihp-inject", "kill:rank=0,at=4"], launcher="local")
    check(proc)
    assert "is a spare" not in proc.stdout + proc.stderr
    executed = read_events(log, "plan")[-1]["executed"]
    assert executed["kept_replicas"] == [1]
    assert [[s["ranks"] for s in r["stages"]] for r in executed["rebuilt_replicas"]] == [[[1, 2]], [[3]]]
    quotas = executed["quotas"]
    assert sum(quotas) == 8 and quotas[0] > quotas[1] >= quotas[2] >= 1, quotas
    adapted = read_events(log, "adapted")
    assert [(a["iteration"], a["world_size"], a["data_parallel_size"]) for a in adapted] == [(4, 7, 3)], adapted
    assert_same_training(log, tmp_path / "ckpt", (tmp_path / "ref", iteration_losses(ref_log)), 16)


def test_a_rank_stopped_from_outside_is_named_hung_at_once_and_survived_in_place(tmp_path, reference):
    # SIGSTOP sent from outside to rank 5's process once iteration 3 is done. Under a 900 s
    # collective timeout only the beacon's view of the stopped process can name it in time.
    log = tmp_path / "events.jsonl"
    args = [*MODEL, "--resihp-enable", "--resihp-collective-timeout-s", "900", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "8",
            "--save", str(tmp_path / "ckpt"), "--resihp-event-log", str(log)]
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--nproc-per-node=8",
           str(REPO / "pretrain_gpt_resilient.py"), *args]
    code, output, sent_at = run_and_signal(cmd, log, rank=5, sig=signal.SIGSTOP, after_iteration=3, timeout_s=240)
    assert sent_at is not None, output[-3000:]
    assert code == 0, output[-3000:]
    assert "sees launch ranks [5] hung ([5]: stopped by a signal)" in output, output[-3000:]
    verdicts = read_events(log, "verdict")
    assert verdicts and all(v["kind"] == "hang" and v["ranks"] == [5] for v in verdicts), verdicts
    adapted = read_events(log, "adapted")
    assert len(adapted) == 1 and adapted[0]["world_size"] == 6 and adapted[0]["failed_ranks"] == [5]
    assert_same_training(log, tmp_path / "ckpt", reference, 16)
