"""Megatron-LM's arithmetic on a replica count that does not divide the global batch."""

import argparse

import pytest

from megatron.resihp.megatron_loop_quotas import replica_counts
from megatron.resihp.megatron_loop_replicas import counted_data_parallel_size, eval_quotas, overcounted_samples


def _args(dp=4, gbs=8, mbs=1, pp=2, vpp=None, full_validation=False, eval_gbs=None):
    return argparse.Namespace(data_parallel_size=dp, global_batch_size=gbs, micro_batch_size=mbs,
                              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                              full_validation=full_validation, eval_global_batch_size=eval_gbs or gbs,
                              eval_micro_batch_size=mbs)


def test_every_live_replica_count_is_kept_unless_the_schedule_or_the_validation_needs_an_even_split():
    assert replica_counts(_args()) == {1, 2, 3, 4}
    assert replica_counts(_args(dp=64, gbs=1024)) == set(range(1, 65))
    # Interleaved: a replica's share runs in whole groups of the pipeline's size (2): 8 over 3 is not.
    assert replica_counts(_args(vpp=2)) == {1, 2, 4}
    # --full-validation samples the validation set by the real data-parallel size.
    assert replica_counts(_args(full_validation=True, gbs=12, eval_gbs=8)) == {1, 2, 4}


@pytest.mark.parametrize("total,replicas,counted", [(8, 3, 2), (8, 4, 4), (1024, 63, 32), (12, 4, 4), (12, 5, 4),
                                                    (7, 6, 1)])
def test_megatrons_arithmetic_is_given_the_largest_size_that_divides_the_batch(total, replicas, counted):
    assert counted_data_parallel_size(total, replicas) == counted


def test_megatrons_calculator_and_schedule_increment_keep_the_global_batch_on_any_replica_count():
    calculator = pytest.importorskip("megatron.core.num_microbatches_calculator")
    gbs, mbs = 1024, 2
    for replicas in range(1, 65):
        size = counted_data_parallel_size(gbs // mbs, replicas)
        calculator.destroy_num_microbatches_calculator()
        calculator.init_num_microbatches_calculator(0, None, gbs, mbs, size, False)  # asserts it divides
        count = calculator.get_num_microbatches()
        assert count * mbs * size == gbs  # train_step's LR increment and the logged batch size
        args = argparse.Namespace(micro_batch_size=mbs, global_batch_size=gbs)
        # train() adds replicas x count x mbs; what is taken off leaves the global batch.
        assert replicas * count * mbs - overcounted_samples(args, replicas, count) == gbs
    calculator.destroy_num_microbatches_calculator()


def test_an_evaluation_splits_its_batch_over_the_real_replicas_only_when_megatron_was_given_another_size():
    args = _args(dp=2, gbs=8)  # 3 replicas live; Megatron's arithmetic counts 2
    assert eval_quotas(args, 3) == [3, 3, 2]
    args.eval_global_batch_size = 12
    assert eval_quotas(args, 3) == [4, 4, 4]
    args.data_parallel_size = 3
    assert eval_quotas(args, 3) is None  # Megatron's own split
