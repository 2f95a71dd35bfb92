"""Megatron-LM's loop on a replica count that does not divide the global batch.

Responsible for keeping Megatron's own arithmetic whole when a fail-stop plan keeps every live
replica and their count R does not divide the global batch's micro-batches (8 on 3 replicas). The
replicas then run uneven quotas, as a fail-slow re-plan's (``megatron_loop_quotas``), and:

- Megatron's ``args.data_parallel_size`` and micro-batch calculator are given the largest count up
  to R that divides the batch (``counted_data_parallel_size``). The calculator asserts that the size
  divides the batch, and ``train_step``'s LR-schedule increment and the logged batch size are its
  count times the micro-batch times that size: the global batch, as they must be;
- ``train()`` adds the size of this rank's data-parallel group times that count times the
  micro-batch to the consumed samples after each step, and counts the step's FLOPs from the same
  product: the over-count is taken off the consumed samples as the step returns (``after_step``,
  before ``train()`` adds), and off the FLOPs where ``train()`` asks for them. The group has R
  ranks, or fewer at a TP rank that a replica at a smaller TP degree lacks
  (``parallel_state_patch``);
- ``evaluate()`` gives every replica the evaluation batch over that size in micro-batches: its
  forward-only calls run this replica's quota of the evaluation batch instead (``eval_quotas``),
  which the validation and test loaders read (``megatron_loop_data``). Megatron sums the losses and
  tokens of all replicas' micro-batches, so the same samples evaluate the same mean.

The same holds for a world grown back by readmission: Megatron is given the smaller size it ran
(its loop asserts that the micro-batch count never falls), and every replica runs its quota.

Where R is the size Megatron was given, nothing here changes anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron.resihp.data_samplers import even_quotas
from megatron.resihp.megatron_loop_quotas import eval_total


def counted_data_parallel_size(total_microbatches: int, replicas: int) -> int:
    """The data-parallel size Megatron's arithmetic is given for ``replicas``: the largest count up
    to it that divides the global batch's ``total_microbatches`` (``replicas`` itself when it does)."""
    return max(d for d in range(1, replicas + 1) if total_microbatches % d == 0)


def overcounted_samples(args, counted: int, microbatches: int) -> int:
    """What ``train()`` over-counts of one step's samples: it adds ``counted`` (the size of this
    rank's data-parallel group) times the calculator's ``microbatches`` times the micro-batch."""
    return counted * microbatches * args.micro_batch_size - args.global_batch_size


def eval_quotas(args, replicas: int) -> list[int] | None:
    """Each replica's micro-batches of one evaluation iteration when ``replicas`` is not the size
    Megatron's arithmetic was given (None: Megatron's own split)."""
    if replicas == args.data_parallel_size:
        return None
    return even_quotas(eval_total(args), replicas)


class CountedSplit:
    """The patches to ``megatron.training.training`` this needs, and the step's correction.

    Args:
        replica_of: this process's (replica, real data-parallel size) in the installed world.
    """

    def __init__(self, replica_of: Callable[[], tuple[int, int]]):
        self._replica_of = replica_of
        self._original: dict[str, Callable] = {}

    def install(self) -> None:
        from megatron.training import training

        self._original = {"get_forward_backward_func": training.get_forward_backward_func,
                          "num_floating_point_operations": training.num_floating_point_operations}
        training.get_forward_backward_func = self._get_forward_backward_func
        training.num_floating_point_operations = self._num_floating_point_operations

    def uninstall(self) -> None:
        from megatron.training import training

        for name, fn in self._original.items():
            setattr(training, name, fn)
        self._original = {}

    @staticmethod
    def set_world(args, replicas: int) -> None:
        """Megatron's data-parallel size for a world of ``replicas`` (its calculator is made from it).

        Never larger than the size it was: ``train()`` asserts that its micro-batch count never
        falls, so a world grown by readmission keeps the smaller world's count, and every replica
        runs its quota of it (``megatron_loop_quotas``), as on a count that does not divide."""
        args.data_parallel_size = counted_data_parallel_size(args.global_batch_size // args.micro_batch_size,
                                                             min(replicas, args.data_parallel_size))

    def after_step(self, args) -> None:
        """As Megatron's step returns: take off the consumed samples what ``train()`` is about to
        over-count (it reads the same group size and micro-batch count)."""
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        counted = parallel_state.get_data_parallel_world_size()
        args.consumed_train_samples -= overcounted_samples(args, counted, get_num_microbatches())

    def _get_forward_backward_func(self, *args, **kwargs):
        run = self._original["get_forward_backward_func"](*args, **kwargs)

        @functools.wraps(run)
        def evaluating_quota(*call, **options):
            if options.get("forward_only"):
                from megatron.training import get_args

                replica, replicas = self._replica_of()
                quotas = eval_quotas(get_args(), replicas)
                if quotas is not None:
                    options["num_microbatches"] = quotas[replica]
            return run(*call, **options)

        return evaluating_quota

    def _num_floating_point_operations(self, args, batch_size, *rest, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        counted = parallel_state.get_data_parallel_world_size()
        # train() passes its data-parallel group's product; its log passes Megatron's (the batch).
        if counted != args.data_parallel_size and \
                batch_size == counted * get_num_microbatches() * args.micro_batch_size:
            batch_size = args.global_batch_size
        return self._original["num_floating_point_operations"](args, batch_size, *rest, **kwargs)
