"""Unequal micro-batch quotas on Megatron-LM's own loop: a fail-slow re-plan's data-parallel split.

Responsible for making the run's quotas (``RunState.quotas``, one per replica) what Megatron's
``train_step`` does, and nothing else:

- this replica's schedule runs its own quota of micro-batches. Megatron calls its forward-backward
  function with the micro-batch calculator's count, which must stay the same on every rank: the
  loop also counts consumed samples with it and saves a checkpoint on the ranks that see it change.
  So the count is replaced at the call (``with_microbatches``) and the calculator left alone;
- its loss is scaled so that Megatron's data-parallel gradient average weights every micro-batch of
  the global batch alike (``loss_factor``): each replica divides by its own count, the average by
  the replica count;
- its loader yields this replica's share of each global batch in Megatron's order
  (``data_samplers.QuotaPretrainingSampler``), with the workers, pinning and collation Megatron's
  ``build_pretraining_data_loader`` chose (``quota_loader``).

Equal quotas keep Megatron's own count, scale and loader.

After a failure every live replica goes on, also when their count does not divide the global batch
(8 micro-batches on 3 replicas: quotas [3, 3, 2]). Megatron's arithmetic is then given a
data-parallel size that does divide it, and what it counts otherwise is corrected
(``megatron_loop_replicas``). Under the interleaved schedule, and with ``--full-validation``, only
counts Megatron splits evenly are kept (``replica_counts``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from megatron.resihp.data_samplers import QuotaPretrainingSampler
from resihp_ext.schedule import interleaved_runs


def replica_counts(args) -> frozenset[int]:
    """How many replicas, up to the launch's, Megatron's loop can run the global batch on after a
    failure. Any count, its micro-batches split as evenly as they go (``megatron_loop_replicas``);
    except that under the interleaved schedule each replica's share must be one the schedule runs
    (in groups of the pipeline's size, megatron-core's default, which Megatron-LM's flags keep), so
    the split is Megatron's even one; and ``--full-validation`` samples the validation set by the
    real data-parallel size, so its count must divide the evaluation batch too."""
    total = args.global_batch_size // args.micro_batch_size
    stages = args.pipeline_model_parallel_size
    launch = range(1, args.data_parallel_size + 1)
    if args.virtual_pipeline_model_parallel_size is not None:
        return frozenset(r for r in launch if total % r == 0 and interleaved_runs(total // r, stages, stages))
    if getattr(args, "full_validation", False):
        return frozenset(r for r in launch if total % r == 0 and eval_total(args) % r == 0)
    return frozenset(launch)


def eval_total(args) -> int:
    """The micro-batches of one evaluation iteration (Megatron's evaluation batch)."""
    return args.eval_global_batch_size // args.eval_micro_batch_size


def uneven(quotas: Sequence[int]) -> bool:
    """Whether ``quotas`` differ between replicas (then Megatron's even split is not the run's)."""
    return len(set(quotas)) > 1


def loss_factor(quotas: Sequence[int], replica: int, per_token_loss: bool) -> float:
    """What ``replica``'s loss is multiplied by so that the data-parallel average of the replicas'
    gradients, each a mean over its own micro-batches, is the mean over the global batch:
    ``quota * replicas / micro-batches``. With ``--calculate-per-token-loss`` Megatron sums over
    micro-batches and divides by the global token count itself, so nothing is needed."""
    if per_token_loss:
        return 1.0
    return quotas[replica] * len(quotas) / sum(quotas)


def scaled_loss(scale_loss: Callable, factor: float) -> Callable:
    """``scale_loss`` (the optimizer's loss scaling, which the schedule applies to the last stage's
    loss before its backward) times ``factor``; ``scale_loss`` itself when ``factor`` is 1."""
    if factor == 1.0:
        return scale_loss
    return lambda loss: scale_loss(loss) * factor


def with_microbatches(forward_backward: Callable, count: int) -> Callable:
    """Megatron's forward-backward function, run over ``count`` micro-batches whatever it is asked."""

    @functools.wraps(forward_backward)
    def run(*args, **kwargs):
        kwargs["num_microbatches"] = count
        return forward_backward(*args, **kwargs)

    return run


def quota_loader(build: Callable, dataset, consumed_samples: int, micro_batch_size: int, quotas: Sequence[int],
                 replica: int) -> torch.utils.data.DataLoader:
    """``replica``'s loader under ``quotas``, from ``consumed_samples`` on. ``build`` is Megatron's
    ``build_pretraining_data_loader``: the loader it makes (never iterated, so it starts no worker)
    gives the settings; the batch sampler is the quota-aware one."""
    stock = build(dataset, consumed_samples)
    sampler = QuotaPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, quotas, replica)
    return torch.utils.data.DataLoader(stock.dataset, batch_sampler=sampler, num_workers=stock.num_workers,
                                       pin_memory=stock.pin_memory, persistent_workers=stock.persistent_workers,
                                       worker_init_fn=stock.worker_init_fn, collate_fn=stock.collate_fn)
