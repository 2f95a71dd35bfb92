"""DP micro-batch quotas: how many micro-batches each data-parallel replica runs.

Responsible for splitting the global batch's micro-batches over replicas so the slowest replica
finishes as early as possible, the quotas always summing to the global batch's count (so each
iteration's gradient equals a failure-free run's). Which samples go where is the data sampler's
job, not this module's.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def replica_time_s(fill_s: float, per_microbatch_s: float, num_microbatches: int) -> float:
    """Affine 1F1B model of one replica: ``fill + m * per_microbatch`` (0 when idle)."""
    return 0.0 if num_microbatches == 0 else fill_s + num_microbatches * per_microbatch_s


def makespan_s(fill_s: Sequence[float], per_microbatch_s: Sequence[float], quotas: Sequence[int]) -> float:
    """Time of the slowest replica under ``quotas``."""
    return max((replica_time_s(f, c, q) for f, c, q in zip(fill_s, per_microbatch_s, quotas)), default=0.0)


def assign_quotas(
    fill_s: Sequence[float],
    per_microbatch_s: Sequence[float],
    num_microbatches: int,
) -> tuple[int, ...]:
    """Integer quotas summing to ``num_microbatches`` that minimise the makespan.

    Greedy: hand out micro-batches one at a time, each to the replica whose finish time after
    taking it, ``T_r(m_r + 1)``, is smallest. Optimal because each ``T_r`` is non-decreasing in
    ``m``: the greedy assigns exactly the ``M`` smallest values of the multiset
    ``{T_r(m) : r, m >= 1}`` (taking each replica's values in order, which a non-decreasing
    sequence allows), so its makespan is the ``M``-th smallest value. Any assignment uses ``M``
    values of that multiset, hence has a largest one at least as big.

    Args:
        fill_s: per replica, pipeline fill/drain seconds (the affine model's intercept).
        per_microbatch_s: per replica, steady-state seconds per micro-batch (inf: cannot run).
        num_microbatches: micro-batches in the global batch.

    Returns:
        One quota per replica, in replica order.
    """
    num_replicas = len(per_microbatch_s)
    if num_replicas != len(fill_s):
        raise ValueError(f"fill_s has {len(fill_s)} entries but per_microbatch_s has {num_replicas}")
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    if num_microbatches and not any(math.isfinite(c) for c in per_microbatch_s):
        raise ValueError("no replica can run micro-batches (all per_microbatch_s are inf)")
    quotas = [0] * num_replicas
    if len(set(fill_s)) == 1 and len(set(per_microbatch_s)) == 1:
        # identical replicas: the greedy deals round-robin, lowest index first
        base, extra = divmod(num_microbatches, num_replicas)
        return tuple(base + (1 if r < extra else 0) for r in range(num_replicas))
    heap = [(replica_time_s(f, c, 1), r) for r, (f, c) in enumerate(zip(fill_s, per_microbatch_s))
            if math.isfinite(c)]
    heapq.heapify(heap)
    for _ in range(num_microbatches):
        _, r = heapq.heappop(heap)
        quotas[r] += 1
        heapq.heappush(heap, (replica_time_s(fill_s[r], per_microbatch_s[r], quotas[r] + 1), r))
    return tuple(quotas)
