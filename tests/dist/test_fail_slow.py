"""Fail-slow handled in place: detected, planned and applied inside the same processes.

Throughput gains are measured by scripts/bench/adaptation.py; this test checks the behaviour:
the verdict names the rank slowed after the detector's warm-up, a plan is applied without a restart, and training stays exact
(losses equal a failure-free run's whatever the plan moved or rebalanced).
"""

import pytest

from tests.dist.launch import (CORE_SPEED_SPREAD, EXACT_GPT, assert_same_losses, check, decisions, iteration_losses,
                               moves_against_plans, read_events, run_job, running_quotas)

MODEL = [*EXACT_GPT, "--train-iters", "34"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """Failure-free losses of MODEL on one process."""
    ref_log = tmp_path_factory.mktemp("fail_slow_reference") / "ref.jsonl"
    check(run_job(1, [*MODEL, "--resihp-event-log", str(ref_log)]))
    return iteration_losses(ref_log)


def test_slow_ranks_are_adapted_in_place_one_after_another_and_training_stays_exact(tmp_path, reference_losses):
    # PP2 x DP2 on 4 processes, on the host's shared cores as they are (no device emulation).
    # Rank 3 (replica 1, stage 1) slows at iteration 10, rank 0 (replica 0, stage 0) at 22, once
    # the detector has warmed up again after the first re-plan.
    log = tmp_path / "events.jsonl"
    check(run_job(4, [*MODEL, "--pipeline-model-parallel-size", "2", "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=3,factor=3,at=10", "--resihp-inject", "slow:rank=0,factor=3,at=22"]))
    assert len(read_events(log, "start")) == 4  # one start per process: nothing restarted
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    # A first estimate of rank 3 may be off when the probes meet a busy host (seen in CI: 2.19x,
    # then 2.98x at the next verdict, which the plan took on); what the later plans act on is checked.
    # A verdict's iteration is its onset: one early when the iteration before the fault was slow
    # by chance (two in a row raise a suspicion, so never two early).
    first = [v for v in verdicts if v["ranks"] == [3] and 9 <= v["iteration"] < 22]
    second = [v for v in verdicts if v["ranks"] == [0] and v["factor"] == pytest.approx(3.0, rel=0.2)
              and v["iteration"] >= 21]
    assert first and second, decisions(log)
    # Each verdict is acted on in place (a noise verdict before the fault may also be, and its
    # plan rolled back when it did not pay); the plan after the second still knows the first slow
    # rank, so quotas stay away from both.
    plans = [p for p in read_events(log, "plan") if p.get("policy") != "rollback"]
    assert any(p["iteration"] >= first[0]["iteration"] for p in plans), decisions(log)
    last = [p for p in plans if "0" in p["slow_rank_factors"]]
    assert last and last[0]["slow_rank_factors"].get("3") == pytest.approx(3.0, rel=0.2), decisions(log)
    assert len([a for a in read_events(log, "adapted") if a["iteration"] >= first[0]["iteration"]]) >= 2, decisions(log)
    # Whatever the plans chose (quotas alone move nothing), each ran exactly the transfers it priced.
    assert all(planned == moved for _, planned, moved in moves_against_plans(log)), moves_against_plans(log)
    assert_same_losses(log, reference_losses, 34)


def test_a_slowdown_the_plan_keeps_is_watched_and_named_again_when_it_worsens(tmp_path):
    """One rank: nothing to move work to, so the plan for its 2x verdict is "keep". Its group used
    to stay muted after that, and the same rank slowing further went unseen.

    A one-rank job's probe is compared with the rank's own healthy probe, and a core of this host
    runs a fixed GEMM at one of two speeds up to 1.72x apart for seconds at a time
    (``CORE_SPEED_SPREAD``), so factors are checked within that band (a 1.6x band failed once in
    CI: an 8x rank read 4.89x, its baseline rounds all in a slow spell); the rank worsens 4x,
    to 8x, so that the worse one reads slower than the first by the probe threshold in any two
    spells. A spell may still have the rank named again or found faster: each later verdict must
    then show it slower than the last by the probe threshold."""
    log = tmp_path / "events.jsonl"
    check(run_job(1, [*MODEL, "--train-iters", "30", "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=0,factor=2,at=10,until=22",
                      "--resihp-inject", "slow:rank=0,factor=8,at=22"]))
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] in ("compute", "recovered")]
    assert verdicts and all(v["ranks"] == [0] for v in verdicts), decisions(log)
    first = verdicts[0]
    assert first["kind"] == "compute" and first["iteration"] < 22, decisions(log)
    assert 2.0 / CORE_SPEED_SPREAD <= first["factor"] <= 2.0 * CORE_SPEED_SPREAD, decisions(log)
    for before, after in zip(verdicts, verdicts[1:]):
        if after["kind"] == "compute":
            assert after["factor"] >= 1.2 * before["factor"], decisions(log)
    worse = [v for v in verdicts if v["kind"] == "compute" and v["evidence"]["probe_iteration"] >= 22]
    assert worse and max(v["factor"] for v in worse) >= 8.0 / CORE_SPEED_SPREAD, decisions(log)
    assert {p["action"] for p in read_events(log, "plan")} == {"keep"}, decisions(log)


def test_a_slow_rank_that_recovers_gets_its_micro_batches_back(tmp_path, reference_losses):
    # Rank 3 runs 3x slow from iteration 10 to 21 (a throttled device that cools down). The
    # re-plan moves micro-batches off replica 1; once the rank is fast again a "recovered" verdict
    # gives them back, in the same processes.
    log = tmp_path / "events.jsonl"
    check(run_job(4, [*MODEL, "--pipeline-model-parallel-size", "2", "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=3,factor=3,at=10,until=22"]))
    assert len(read_events(log, "start")) == 4
    assert [e["iteration"] for e in read_events(log, "inject_end")] == [22], decisions(log)
    verdicts = read_events(log, "verdict")
    slow = [v for v in verdicts if v["kind"] == "compute" and v["ranks"] == [3] and v["iteration"] >= 9]
    back = [v for v in verdicts if v["kind"] == "recovered" and v["ranks"] == [3]]
    # The onset of a recovery, like a slowdown's, may be one early: with 2 of 8 micro-batches
    # left on rank 3, a fast spell of the host can make its last slow iteration look fast (seen in CI).
    assert slow and back and back[0]["iteration"] >= 21, decisions(log)
    assert back[0]["factor"] == pytest.approx(1.0, abs=0.2) and back[0]["evidence"]["known_factors"]["3"] > 2
    adapted = read_events(log, "adapted")
    before = [a for a in adapted if slow[0]["iteration"] <= a["iteration"] < back[0]["iteration"]]
    after = [a for a in adapted if a["iteration"] >= back[0]["evidence"]["confirm_probe_iteration"]]
    assert before and before[-1]["quotas"][1] < before[-1]["quotas"][0], decisions(log)
    # On a busy host the trial after the first re-plan can read the iterations of another job's
    # load as the plan's and roll it back (seen here with a suite running beside it): the
    # micro-batches are then back before the recovery, which has none left to give.
    rolled = [r for r in read_events(log, "rolled_back") if r["iteration"] <= back[0]["iteration"]]
    assert (after and after[0]["quotas"] == [4, 4]) or rolled, decisions(log)
    assert_same_losses(log, reference_losses, 34)


def test_a_failure_after_a_slowdown_splits_the_batch_by_the_known_speeds(tmp_path, reference_losses):
    # DP4 on 4 processes (rank = replica). Rank 0 slows 3x at iteration 10 and is re-planned
    # around; rank 3 is killed at 20. The survivors' plan still knows rank 0 is slow, so replica 0
    # keeps a small share of the batch rather than Megatron's even split.
    # 16 micro-batches of 1 sample: keeping rank 0 with 1 of them (5 units per iteration) beats
    # leaving it out ([6, 5, 5]) for any estimate of its slowdown up to 5x. With 8 micro-batches of
    # 2 the two tie at 3x, and an estimate of 4.2x (seen in CI) left rank 0 out.
    log = tmp_path / "events.jsonl"
    check(run_job(4, [*_with(MODEL, "--micro-batch-size", "1"), "--resihp-enable", "--resihp-collective-timeout-s", "5",
                      "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=0,factor=3,at=10", "--resihp-inject", "kill:rank=3,at=20"],
                  launcher="local"))
    slow = [v for v in read_events(log, "verdict") if v["kind"] == "compute" and v["ranks"] == [0]
            and 10 <= v["iteration"] < 20]
    assert slow, decisions(log)
    survivors = [p for p in read_events(log, "plan") if "executed" in p]
    assert len(survivors) == 1 and survivors[0]["iteration"] == 20, decisions(log)
    quotas = survivors[0]["executed"]["quotas"]
    assert len(quotas) == 3 and 1 <= quotas[0] < min(quotas[1:]), decisions(log)
    assert "known slow ranks [0]" in survivors[0]["reason"], decisions(log)
    adapted = [a for a in read_events(log, "adapted") if a["iteration"] == 20]
    assert adapted and adapted[0]["world_size"] == 3 and adapted[0]["quotas"] == quotas, decisions(log)
    assert_same_losses(log, reference_losses, 34)


def _with(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with the value of ``flag`` replaced."""
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


ISSUE_SHAPE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--cpu-device-time-scale", "4"]
ITERS = 16
SHORT = [a if a != "34" else str(ITERS) for a in MODEL]


@pytest.fixture(scope="module")
def issue_shape_reference(tmp_path_factory):
    """Failure-free losses of the issue's shape (emulated devices, K = 4)."""
    ref_log = tmp_path_factory.mktemp("issue_shape_reference") / "ref.jsonl"
    check(run_job(8, [*SHORT, *ISSUE_SHAPE, "--resihp-event-log", str(ref_log)]))
    return iteration_losses(ref_log)


def test_tp2_pp2_dp2_rank_slowed_2x_at_iteration_10_is_replanned_in_place(tmp_path, issue_shape_reference):
    # The shape of the issue: TP2 x PP2 x DP2 on 8 processes, rank 7 (replica 1, last stage, TP
    # rank 1) slowed 2x at iteration 10. Each rank emulates a device of its own
    # (--cpu-device-time-scale), so the slow rank bounds its pipeline as it would on GPUs.
    log = tmp_path / "events.jsonl"
    check(run_job(8, [*SHORT, *ISSUE_SHAPE, "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=7,factor=2,at=10"]))
    assert len(read_events(log, "start")) == 8
    verdicts = [v for v in read_events(log, "verdict") if v["kind"] == "compute"]
    # Named slow beyond the 1.25x threshold, not named faster than it is. How near 2x the factor
    # reads is the detection benchmark's measure: here 8 processes share 2 cores, and a probe round
    # beside a busy neighbour has read this 2x rank at 1.48x (seen in CI, its first round 1.77x).
    named = [v for v in verdicts if v["ranks"] == [7] and 1.25 < v["factor"] <= 2.4]
    assert named and named[0]["iteration"] <= 13, decisions(log)
    adapted = [a for a in read_events(log, "adapted") if a["iteration"] >= named[0]["iteration"]]
    assert adapted, decisions(log)
    assert_same_losses(log, issue_shape_reference, ITERS)


def test_a_replan_that_does_not_pay_is_rolled_back_and_not_made_again(tmp_path, reference_losses):
    # DP2 on 2 processes: rank 1 runs 3x slow from iteration 8, and the planner is fed a false speed
    # for rank 0 (10x slower than measured), so it sends most micro-batches to the slow rank. The
    # iterations after that re-plan run slower than before it: within the trial's window the quotas
    # go back, the same change is not made again, and training stays exact throughout.
    log = tmp_path / "events.jsonl"
    check(run_job(2, [*MODEL, "--resihp-enable", "--resihp-event-log", str(log),
                      "--resihp-inject", "slow:rank=1,factor=3,at=8", "--resihp-inject", "misjudge:rank=0,factor=10,at=1"]))
    wrong = [p for p in read_events(log, "plan") if p["action"] == "adapt" and p["policy"] == "resihp"]
    assert wrong and wrong[0]["quotas"][1] > wrong[0]["quotas"][0], decisions(log)
    checks = read_events(log, "adaptation_check")
    assert checks and not checks[0]["kept"] and checks[0]["replanned_at"] == wrong[0]["iteration"], decisions(log)
    assert checks[0]["iteration"] == wrong[0]["iteration"] + 4  # one settling iteration, three measured
    assert checks[0]["measured_after_s"] > checks[0]["before_s"]
    back = read_events(log, "rolled_back")
    assert [(b["iteration"], b["quotas"]) for b in back][:1] == [(checks[0]["iteration"], [4, 4])], decisions(log)
    assert [p["quotas"] for p in wrong[1:]].count(wrong[0]["quotas"]) == 0, decisions(log)
    # A later verdict (seen in CI: the slow rank's first estimate 4.9x, then "faster again" at 2.7x)
    # can lead the misled planner to another change the same way; it is on trial too, and goes back.
    assert all(not c["kept"] for c in checks) and len(back) == len(checks), decisions(log)
    assert running_quotas(log) == [4, 4], decisions(log)
    assert_same_losses(log, reference_losses, 34)
