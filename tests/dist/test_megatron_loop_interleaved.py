"""Resilience under the interleaved schedule on Megatron-LM's loop, TP1 x PP2 with two model chunks per
rank (``--num-layers-per-virtual-pipeline-stage 1``), global batch 8: fail-stop on 8 CPU ranks (DP 4),
fail-slow on 4 (DP 2).

Stock Megatron-LM runs the same flags through ``pretrain_gpt_resilient.py`` as the reference. Two kills:
the first breaks a replica; the interleaved schedule runs a replica's share in whole groups of the
pipeline's size (2), which 8 micro-batches over 3 replicas are not, so the survivors go on as 2
replicas, and the ranks left out stand by as spares. The second takes a spare of stage 0
back in a dead rank's place on stage 1, where it receives that stage's layers, which megatron-core
places apart (stage 1 holds layers 1 and 3). Every logged loss and the saved weights of both chunks
equal the failure-free run's.

A rank slowed 3x is named from the timings of the interleaved schedule's chunk ops (the detector
walks that schedule, ``resihp_ext.schedule.interleaved``), and its replica is given fewer
micro-batches in whole groups of the pipeline's size, the only counts the schedule runs; layers stay
where megatron-core placed them, since the job saves in the ``torch`` format (layer moves under this
schedule: ``test_megatron_loop_layer_moves.py``). Every logged loss and the saved weights equal stock
Megatron-LM's.
"""

from __future__ import annotations

import pytest

from resihp_ext.detection.traces import load_trace
from resihp_ext.schedule import Interleaving, OpKind, interleaved
from tests.dist.launch import check, decisions, read_events, run_job, running_quotas
from tests.dist.megatron_jobs import assert_same_training, job_args, replaced, stock_training

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")


def interleaved_args(tmp, name: str) -> list[str]:
    args = job_args(tmp, name)  # global batch 8: 2 micro-batches per replica at DP 4, 4 at DP 2
    args[args.index("--tensor-model-parallel-size") + 1] = "1"
    return [*args, "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    return stock_training(8, interleaved_args(tmp_path_factory.mktemp("interleaved"), "ckpt"))


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["replicated", "distributed"])
def test_a_spare_takes_a_dead_ranks_place_on_another_stage_and_the_training_is_stock(tmp_path, failure_free, optimizer):
    events = tmp_path / "events.jsonl"
    # Launch ranks 0-3 are stage 0 of replicas 0-3, ranks 4-7 their stage 1.
    proc = run_job(8, [*interleaved_args(tmp_path, "ckpt"), *optimizer, "--resihp-enable", "--resihp-event-log",
                       str(events), "--resihp-inject", "kill:rank=7,at=4", "--resihp-inject", "kill:rank=4,at=6"],
                   timeout_s=420)
    check(proc)
    assert ("fail-slow detection on, re-plans of the micro-batch split only (layers stay on their stages: "
            "--ckpt-format torch saves") in proc.stdout
    assert "(1 more left out: the global batch of 8 micro-batches splits evenly over 2 replicas)" in proc.stdout
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["failed_launch_ranks"], a["taken_back_launch_ranks"], a["data_parallel_size"])
            for a in adapted] == [(4, [7], [], 2), (6, [4], [2], 2)], adapted
    if not optimizer:
        # The spare receives stage 1's layers, which megatron-core places apart (1 and 3), and the
        # output layer, from the stage's live rank.
        sent = [(tuple(t["item"]), t["dst"]) for e in read_events(events, "moved") if e["iteration"] == 6
                for t in e["sent"] if not t["replicated"]]
        assert sorted(item for item, _ in sent) == [("last",), ("layer", 1), ("layer", 3)], sent
        assert len({dst for _, dst in sent}) == 1, sent
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)


SLOW_ITERATIONS = 16


def dp2_args(tmp, name: str) -> list[str]:
    """The interleaved job on 4 ranks: TP1 x PP2 x DP2, 4 micro-batches per replica (two groups of 2)."""
    return replaced(interleaved_args(tmp, name), {"--train-iters": str(SLOW_ITERATIONS)})


@pytest.fixture(scope="module")
def dp2_failure_free(tmp_path_factory):
    return stock_training(4, dp2_args(tmp_path_factory.mktemp("interleaved_dp2"), "ckpt"))


def test_a_slow_rank_is_named_from_the_chunk_ops_and_its_replica_given_fewer_groups_exactly(tmp_path,
                                                                                         dp2_failure_free):
    # Launch rank 3 is replica 1's stage 1. The re-plan's trial is off, as in
    # tests/dist/test_megatron_loop_fail_slow.py: this test holds the split to Megatron's numbers.
    events, trace = tmp_path / "events.jsonl", tmp_path / "trace.jsonl"
    proc = run_job(4, [*dp2_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-trace", str(trace), "--resihp-verify-iters", "0",
                       "--resihp-inject", "slow:rank=3,factor=3,at=5"], timeout_s=420)
    check(proc)
    named = [v for v in read_events(events, "verdict") if v["kind"] == "compute" and v["ranks"] == [3]]
    assert named and named[0]["iteration"] >= 4, decisions(events)
    adapted = [a for a in read_events(events, "adapted") if a["iteration"] >= named[0]["iteration"]]
    assert adapted, decisions(events)
    assert all(a["layers_per_replica"] == [[2, 2], [2, 2]] for a in adapted), adapted
    quotas = running_quotas(events)
    assert quotas[1] < quotas[0] and sum(quotas) == 8 and all(q % 2 == 0 for q in quotas), quotas
    assert_same_training(proc.stdout, tmp_path / "ckpt", dp2_failure_free, iterations=range(1, SLOW_ITERATIONS + 1))
    # Every rank's recorded ops, before and after the re-plan, come in the interleaved schedule's
    # order for its replica's count: its stage's warm-up of forwards, then forwards and backwards
    # in turn (each op numbered by its place among its kind: the k-th is virtual micro-batch k).
    recorded_trace = load_trace(str(trace))
    assert recorded_trace.interleaving() == Interleaving(2)
    counts = set()
    for iteration, observations in recorded_trace.iterations.items():
        assert sorted(o.rank for o in observations) == [0, 1, 2, 3]
        for obs in observations:
            count = len(obs.features) // 2
            counts.add((obs.replica, count))
            want = _numbered(interleaved(2, 2, count, 2)[obs.stage])
            recorded = [(kind, column) for kind, column, _, _ in obs.ops]
            assert recorded == want, f"iteration {iteration} rank {obs.rank}: {recorded} != {want}"
    assert counts == {(0, 4), (1, 4), (0, quotas[0]), (1, quotas[1])}, counts


def _numbered(ops) -> list[tuple[str, int]]:
    """Each op as ``(kind, its place among the stage's ops of that kind)``."""
    seen = {kind: 0 for kind in OpKind}
    numbered = []
    for op in ops:
        numbered.append((op.kind.value, seen[op.kind]))
        seen[op.kind] += 1
    return numbered
