"""The data iterators Megatron-LM's loop reads, rebuilt for a re-formed world.

Responsible for: noting the datasets Megatron builds its loaders from (training, validation, test,
in that order, once per model chunk under the interleaved schedule, whose chunks each read the
batch) and the validation iterator ``train()`` is given; after a re-form, building each
set's loader again with Megatron's own ``build_pretraining_data_loader`` for the new data-parallel
rank and size (its sampler reads them from the installed groups) at the samples already read:
training at the job's consumed samples and this replica's quota of the global batch
(``megatron_loop_quotas``), validation at Megatron's validation count, test from its start (Megatron
reads it once, as the job ends), each at this replica's share of the evaluation batch when the
replicas do not split it evenly (``megatron_loop_replicas``). An evaluation then reads the rebuilt
loader of the set it was given. The training iterator is handed to Megatron's step in place of the
loop's own; the workers of the iterators a rebuild replaces end with it. Under the interleaved
schedule each of them is a list, one per model chunk, as Megatron's own are.
"""

from __future__ import annotations

import torch

from megatron.resihp import megatron_loop_quotas as quota_split
from megatron.resihp.megatron_loop_replicas import eval_quotas


class LoopData:
    """``build``: Megatron's ``build_pretraining_data_loader``."""

    def __init__(self, build):
        self._build = build
        # In the order Megatron built their loaders: training, validation, test, for each model chunk.
        self.datasets: list = []
        self.train_iterator = None  # None until a re-form: the loop's own
        self.valid_iterator = None
        self.test_iterator = None
        self.loop_valid = None  # the validation iterator Megatron's train() was given
        self.loop_train = None  # the training iterator Megatron's train() was given

    def built(self, dataset) -> None:
        """Megatron built a loader of ``dataset`` (None for a set the job has not)."""
        self.datasets.append(dataset)

    def eval_iterator(self, given):
        """What an evaluation Megatron runs on ``given`` (its validation or test iterator) reads."""
        if self.valid_iterator is None and self.test_iterator is None:  # no re-form yet
            return given
        rebuilt = self.valid_iterator if given is self.loop_valid else self.test_iterator
        return given if rebuilt is None else rebuilt

    def rebuild(self, args, run, consumed: int, train_only: bool = False) -> None:
        """Loaders for the data-parallel rank, size and quotas of ``run`` at ``consumed`` training
        samples; the validation and test loaders too unless ``train_only``. The default generator
        is left where it was: on a CPU it is also dropout's."""
        from megatron.core.rerun_state_machine import RerunDataIterator

        chunks = len(run.objects.chunks)

        def dataset(chunk: int, index: int):
            if run.tp_rank != 0:  # TP rank 0 reads for its group (a rank may hold the data for a later TP 1)
                return None
            index += 3 * chunk
            return self.datasets[index] if len(self.datasets) > index else None

        def train(chunk: int):
            found = dataset(chunk, 0)
            if found is None:
                return None
            if quota_split.uneven(run.quotas):
                return RerunDataIterator(iter(quota_split.quota_loader(
                    build, found, consumed, args.micro_batch_size, run.quotas, run.replica)))
            return RerunDataIterator(iter(build(found, consumed)))

        def evaluated(chunk: int, index: int, consumed_samples: int):
            found = dataset(chunk, index)
            if found is None:
                return None
            if eval_split is not None and quota_split.uneven(eval_split):
                return RerunDataIterator(iter(quota_split.quota_loader(
                    build, found, consumed_samples, args.eval_micro_batch_size, eval_split, run.replica)))
            return RerunDataIterator(iter(build(found, consumed_samples)))

        def per_chunk(make):  # one iterator, or under the interleaved schedule one per chunk
            made = [make(chunk) for chunk in range(chunks)]
            return made[0] if chunks == 1 else made

        build = self._build
        eval_split = eval_quotas(args, len(run.quotas))
        state = torch.get_rng_state()
        try:
            stop_workers(self.train_iterator if self.train_iterator is not None else self.loop_train)
            self.train_iterator = per_chunk(train)
            if train_only:
                return
            stop_workers(self.valid_iterator if self.valid_iterator is not None else self.loop_valid)
            stop_workers(self.test_iterator)
            self.valid_iterator = per_chunk(lambda chunk: evaluated(chunk, 1, args.consumed_valid_samples))
            self.test_iterator = per_chunk(lambda chunk: evaluated(chunk, 2, 0))
        finally:
            torch.set_rng_state(state)


def stop_workers(iterator) -> None:
    """End the worker processes of a loader iterator that will not be read again (one per model
    chunk under the interleaved schedule). Dropping it is not enough: Megatron's ``train()`` holds
    the iterators it was given for as long as it runs, and their workers (``--num-workers`` forked
    processes each) would wait for indices until the job ends. A loader without workers, or one
    already stopped, is left as it is."""
    for one in iterator if isinstance(iterator, list) else [iterator]:
        loader_iter = getattr(one, "iterable", one)  # Megatron wraps it in a RerunDataIterator
        shutdown = getattr(loader_iter, "_shutdown_workers", None)  # torch's own, as its __del__ calls
        if shutdown is not None:
            shutdown()
