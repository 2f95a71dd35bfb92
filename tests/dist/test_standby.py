"""A rank a fail-slow plan leaves out stands by in its own process and rejoins once healthy.

TP2 x DP2 on 4 processes (rank = TP rank + 2 * replica). Rank 3 runs 8x slow from iteration 7 to
16 (a device that throttles, then cools down). The plan runs replica 1 at TP 1 on rank 2 and
leaves rank 3 out; rank 3 stands by, probing its own device. Rank 0 is then killed at 14: the
survivors re-form a world of two (ranks 1 and 2, renumbered 0 and 1, each a TP-1 replica) while
rank 3 stands by. Once rank 3's slowdown ends it reports healthy and rejoins the grown world as
its rank 2, and launch replica 1 runs at TP 2 again. No restart, and the losses of a failure-free
run throughout.
"""

import pytest

from tests.dist.launch import check, decisions, iteration_losses, read_events, run_job
from tests.dist.test_fail_slow import MODEL

ITERS = 80  # short iterations: the rejoin must pay back its regrouping (about 40 of them here) in what is left
RUN = [*[a if a != "34" else str(ITERS) for a in MODEL], "--resihp-collective-timeout-s", "10",
       "--resihp-standby-probe-interval-s", "0.3"]
SHAPE = [*RUN, "--tensor-model-parallel-size", "2"]
SLOW = "slow:rank=3,factor=8,at=7,until=16"


def test_a_rank_left_out_for_a_slowdown_stands_by_through_a_failure_and_rejoins_when_healthy(tmp_path):
    ref_log = tmp_path / "reference.jsonl"
    check(run_job(1, [*RUN, "--resihp-event-log", str(ref_log)]))
    log = tmp_path / "events.jsonl"
    proc = run_job(4, [*SHAPE, "--resihp-enable", "--resihp-event-log", str(log), "--resihp-inject", SLOW,
                       "--resihp-inject", "kill:rank=0,at=14"], launcher="local")
    check(proc)
    assert len(read_events(log, "start")) == 4  # nothing restarted
    plans = read_events(log, "plan")
    assert any("excluding ranks [3]" in p["reason"] for p in plans), decisions(log)
    standby = read_events(log, "standby")
    assert [(e["rank"], e["launch_rank"]) for e in standby] == [(3, 3)], decisions(log)
    adapted = read_events(log, "adapted")
    # The fail-stop while rank 3 stood by: a world of two TP-1 replicas.
    assert [(a["world_size"], a["failed_ranks"]) for a in adapted if "failed_ranks" in a] == [(2, [0])], \
        decisions(log)
    rejoin = [p for p in plans if p.get("policy") == "readmission" and p["action"] == "adapt"]
    assert rejoin and rejoin[0]["iteration"] > 16 and rejoin[0]["ready"] == {"3": pytest.approx(1.0, abs=0.2)}, \
        decisions(log)
    grown = [a for a in adapted if a.get("joined_launch_ranks") == [3]]
    assert grown and grown[0]["world_size"] == 3 and grown[0]["quotas"][0] > grown[0]["quotas"][1], decisions(log)
    assert "launch rank 3 rejoined as rank 2 of 3" in proc.stdout + proc.stderr
    # Rank 3 trained again: the last rank of the grown world logs the iterations after it joined.
    after = [e for e in read_events(log, "iteration") if e["iteration"] > grown[0]["iteration"]]
    assert after and {e["rank"] for e in after} == {3}
    assert not read_events(log, "exit"), decisions(log)  # every live process finished the job
    ours, reference = iteration_losses(log), iteration_losses(ref_log)
    assert sorted(ours) == list(range(1, ITERS + 1))
    assert [ours[i] for i in range(1, ITERS + 1)] == pytest.approx([reference[i] for i in range(1, ITERS + 1)],
                                                                    rel=1e-5)


def test_without_standby_the_rank_left_out_exits(tmp_path):
    log = tmp_path / "events.jsonl"
    proc = run_job(4, [*SHAPE, "--resihp-enable", "--resihp-no-standby", "--resihp-event-log", str(log),
                       "--resihp-inject", SLOW, "--train-iters", "40"], launcher="local")
    check(proc)
    assert not read_events(log, "standby")
    exits = read_events(log, "exit")
    assert [e["rank"] for e in exits] == [3] and "spare after the re-plan" in exits[0]["reason"], decisions(log)
