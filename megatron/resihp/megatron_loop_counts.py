"""Megatron's micro-batch count across re-forms, on Megatron-LM's own loop.

Responsible for one thing: when Megatron's micro-batch calculator is made anew for the world's
data-parallel size. ``train()`` saves a checkpoint at the top of the first iteration that sees the
count change, so every member of a world must see the change at the same iteration's top: a
survivor an iteration behind the furthest one, and a spare taken back, count anew only as they
enter the step the furthest survivor stood in (``count_anew_at``, then ``at_step``). The global
batch is always kept.
"""

from __future__ import annotations


class MicrobatchCount:
    """Megatron's micro-batch calculator, made anew for a world's data-parallel size."""

    def __init__(self):
        self._anew_at: int | None = None  # the step at which to count anew (a rank an iteration behind)

    def count_anew_at(self, iteration: int) -> None:
        """Count for this world's data-parallel size from step ``iteration`` on."""
        self._anew_at = iteration

    def at_step(self, iteration: int) -> None:
        """Step ``iteration`` begins: count anew if this is the step it was put off to."""
        if self._anew_at == iteration:
            self.count_now()

    def count_now(self, data_parallel_size: int | None = None) -> None:
        """Megatron's calculator for the installed world's data-parallel size (Megatron's
        ``args.data_parallel_size``), or for ``data_parallel_size``."""
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator, init_num_microbatches_calculator,
        )
        from megatron.training import get_args

        args = get_args()
        self._anew_at = None
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                         data_parallel_size or args.data_parallel_size,
                                         args.decrease_batch_size_if_needed)

    def as_before(self, microbatches: int) -> None:
        """The calculator at ``microbatches`` per replica: the count the survivors' ``train()``
        started this world with (a spare taken back enters it with that)."""
        from megatron.training import get_args

        args = get_args()
        self.count_now(args.global_batch_size // (args.micro_batch_size * microbatches))
