"""Quota-aware pretraining sampler: unequal micro-batch shares per DP replica, no sample lost.

Iteration ``i`` consumes the samples ``[consumed, consumed + global_batch_size)`` of the training
set, cut into ``global_batch_size / micro_batch_size`` micro-batches. Replica ``r`` takes the
contiguous run of micro-batches ``[sum(quotas[:r]), sum(quotas[:r + 1]))``. Whatever the quotas
(even 0 for a replica), the union over replicas is the whole global batch, each sample exactly
once, so ``consumed_samples`` alone is the checkpointable state. It never talks to other ranks:
every rank is handed the same quotas.

On Megatron-LM's own loop the split follows Megatron's order instead (``QuotaPretrainingSampler``):
micro-batch slots go round the replicas, each taking one per round while its quota lasts, so
equal quotas give every replica exactly the samples ``MegatronPretrainingSampler`` gives it, and a
re-plan's unequal ones change which replica trains a sample, never which samples a step trains.
"""

from __future__ import annotations

from typing import Sequence

from torch.utils.data import default_collate


class GlobalBatchSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, global_batch_size: int):
        if global_batch_size % micro_batch_size:
            raise ValueError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def microbatch_indices(self, quotas: Sequence[int], replica: int) -> list[list[int]]:
        """Sample indices of each micro-batch replica ``replica`` runs in the next iteration."""
        if sum(quotas) != self.num_microbatches or min(quotas) < 0:
            raise ValueError(f"quotas {list(quotas)} must be >= 0 and sum to {self.num_microbatches} micro-batches")
        if self.consumed_samples + self.global_batch_size > self.total_samples:
            raise ValueError(
                f"training set exhausted: {self.consumed_samples} consumed of {self.total_samples}; "
                "build the dataset for more samples (--train-iters x --global-batch-size)"
            )
        first_mb = sum(quotas[:replica])
        start = self.consumed_samples + first_mb * self.micro_batch_size
        mbs = self.micro_batch_size
        return [list(range(start + k * mbs, start + (k + 1) * mbs)) for k in range(quotas[replica])]

    def advance(self) -> None:
        self.consumed_samples += self.global_batch_size


def megatron_order_slots(quotas: Sequence[int], replica: int) -> list[int]:
    """The micro-batch slots of a global batch (slot ``j``: its samples ``[j * mbs, (j + 1) * mbs)``)
    that ``replica`` takes in Megatron's order: round ``k`` gives the next slot to every replica
    with more than ``k`` micro-batches, in replica order."""
    slots, slot = [], 0
    for k in range(max(quotas, default=0)):
        for r, quota in enumerate(quotas):
            if quota > k:
                if r == replica:
                    slots.append(slot)
                slot += 1
    return slots


class QuotaPretrainingSampler:
    """A batch sampler in place of Megatron's ``MegatronPretrainingSampler`` when replicas run
    unequal micro-batch quotas: yields this replica's micro-batches (lists of sample indices) of
    each global batch from ``consumed_samples`` on, in Megatron's order (``megatron_order_slots``).
    Megatron's own checkpoints carry its state: the consumed sample count."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, quotas: Sequence[int],
                 replica: int):
        if min(quotas) < 0 or not 0 <= replica < len(quotas):
            raise ValueError(f"replica {replica} of quotas {list(quotas)}: quotas must be >= 0, one per replica")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = micro_batch_size * sum(quotas)
        self.slots = megatron_order_slots(quotas, replica)

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        mbs, start = self.micro_batch_size, self.consumed_samples
        while start + self.global_batch_size <= self.total_samples:
            for slot in self.slots:
                yield list(range(start + slot * mbs, start + (slot + 1) * mbs))
            start += self.global_batch_size


def microbatches(dataset, indices: list[list[int]]) -> list[dict]:
    """Collate each micro-batch's samples into one batch dict."""
    return [default_collate([dataset[i] for i in mb]) for mb in indices]


def even_quotas(num_microbatches: int, num_replicas: int) -> list[int]:
    """Equal shares, the first replicas taking the remainder."""
    base, extra = divmod(num_microbatches, num_replicas)
    return [base + (r < extra) for r in range(num_replicas)]
