"""Resilience under the interleaved schedule on Megatron-LM's loop, 8 CPU ranks TP1 x PP2 x DP4 with two
model chunks per rank (``--num-layers-per-virtual-pipeline-stage 1``), global batch 8.

Stock Megatron-LM runs the same flags through ``pretrain_gpt_resilient.py`` as the reference. Two kills:
the first breaks a replica; the interleaved schedule runs a replica's share in whole groups of the
pipeline's size (2), which 8 micro-batches over 3 replicas are not, so the survivors go on as 2
replicas, and the ranks left out stand by as spares. The second takes a spare of stage 0
back in a dead rank's place on stage 1, where it receives that stage's layers, which megatron-core
places apart (stage 1 holds layers 1 and 3). Every logged loss and the saved weights of both chunks
equal the failure-free run's.
"""

from __future__ import annotations

import pytest

from tests.dist.launch import check, read_events, run_job
from tests.dist.megatron_jobs import assert_same_training, job_args, stock_training

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
    assert "fail-slow detection off (the detector models the non-interleaved 1F1B schedule's op order" in proc.stdout
    assert "(1 more left out: the global batch of 8 micro-batches splits evenly over 2 replicas)" in proc.stdout
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["failed_launch_ranks"], a["taken_back_launch_ranks"], a["data_parallel_size"])
            for a in adapted] == [(4, [7], [], 2), (6, [4], [2], 2)], adapted
    if not optimizer:
        # The spare receives stage 1's layers, numbered 2 and 3 as a Layout counts a stage's layers in a
        # row (megatron-core's 1 and 3), and the output layer, from the stage's live rank.
        sent = [(tuple(t["item"]), t["dst"]) for e in read_events(events, "moved") if e["iteration"] == 6
                for t in e["sent"] if not t["replicated"]]
        assert sorted(item for item, _ in sent) == [("last",), ("layer", 2), ("layer", 3)], sent
        assert len({dst for _, dst in sent}) == 1, sent
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free)
