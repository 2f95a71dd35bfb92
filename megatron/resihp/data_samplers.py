"""Quota-aware pretraining sampler: unequal micro-batch shares per DP replica, no sample lost.

Iteration ``i`` consumes the samples ``[consumed, consumed + global_batch_size)`` of the training
set, cut into ``global_batch_size / micro_batch_size`` micro-batches. Replica ``r`` takes the
contiguous run of micro-batches ``[sum(quotas[:r]), sum(quotas[:r + 1]))``. Whatever the quotas
(even 0 for a replica), the union over replicas is the whole global batch, each sample exactly
once, so ``consumed_samples`` alone is the checkpointable state. It never talks to other ranks:
every rank is handed the same quotas.
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


def microbatches(dataset, indices: list[list[int]]) -> list[dict]:
    """Collate each micro-batch's samples into one batch dict."""
    return [default_collate([dataset[i] for i in mb]) for mb in indices]


def even_quotas(num_microbatches: int, num_replicas: int) -> list[int]:
    """Equal shares, the first replicas taking the remainder."""
    base, extra = divmod(num_microbatches, num_replicas)
    return [base + (r < extra) for r in range(num_replicas)]
