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
    minimum: int = 1,
    step: int = 1,
) -> tuple[int, ...]:
    """Integer quotas summing to ``num_microbatches`` that minimise the makespan, every replica
    that can run taking at least ``minimum``, each a multiple of ``step`` (the interleaved
    schedule's micro-batch group: ``cost.quota_step``).

    A replica in the job trains at least one micro-batch by default: an idle one would still wait
    on every gradient sync, and Megatron's schedule has no empty pass. A replica too slow to earn
    one is better dropped, which is the planner's choice, not the split's.

    Greedy: start every runnable replica at ``minimum``, then hand out the rest one at a time, each
    to the replica whose finish time after taking it, ``T_r(m_r + 1)``, is smallest. Optimal
    because each ``T_r`` is non-decreasing in ``m``: beyond the minimums (whose largest finish
    time every split pays), the greedy assigns exactly the ``M`` smallest values of the multiset
    ``{T_r(m) : r, m > minimum}`` (taking each replica's values in order, which a non-decreasing
    sequence allows), so its makespan is the larger of the ``M``-th smallest value and the
    minimums' finish. Any split uses ``M`` values of that multiset on top of the same minimums,
    hence has a makespan at least as big.

    Args:
        fill_s: per replica, pipeline fill/drain seconds (the affine model's intercept).
        per_microbatch_s: per replica, steady-state seconds per micro-batch (inf: cannot run).
        num_microbatches: micro-batches in the global batch.
        minimum: least micro-batches of each replica that can run (0 lets a slow one idle), in
            steps when ``step`` is above 1.
        step: every quota is a multiple of it; ``num_microbatches`` must be one too.

    Returns:
        One quota per replica, in replica order.
    """
    if step > 1:
        if num_microbatches % step:
            raise ValueError(f"{num_microbatches} micro-batches are not whole steps of {step}")
        # A step is one unit of work costing ``step`` micro-batches.
        units = assign_quotas(fill_s, [c * step for c in per_microbatch_s], num_microbatches // step, minimum)
        return tuple(u * step for u in units)
    num_replicas = len(per_microbatch_s)
    if num_replicas != len(fill_s):
        raise ValueError(f"fill_s has {len(fill_s)} entries but per_microbatch_s has {num_replicas}")
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    if num_microbatches and not any(math.isfinite(c) for c in per_microbatch_s):
        raise ValueError("no replica can run micro-batches (all per_microbatch_s are inf)")
    runnable = [r for r, c in enumerate(per_microbatch_s) if math.isfinite(c)]
    if minimum * len(runnable) > num_microbatches:
        raise ValueError(f"{num_microbatches} micro-batches cannot give each of {len(runnable)} replicas "
                         f"{minimum}; drop a replica or pass a smaller minimum")
    if len(set(fill_s)) == 1 and len(set(per_microbatch_s)) == 1 and runnable:
        # identical replicas: the greedy deals round-robin, lowest index first
        base, extra = divmod(num_microbatches, num_replicas)
        return tuple(base + (1 if r < extra else 0) for r in range(num_replicas))
    quotas = [0] * num_replicas
    for r in runnable:
        quotas[r] = minimum
    heap = [(replica_time_s(fill_s[r], per_microbatch_s[r], minimum + 1), r) for r in runnable]
    heapq.heapify(heap)
    for _ in range(num_microbatches - minimum * len(runnable)):
        _, r = heapq.heappop(heap)
        quotas[r] += 1
        heapq.heappush(heap, (replica_time_s(fill_s[r], per_microbatch_s[r], quotas[r] + 1), r))
    return tuple(quotas)
