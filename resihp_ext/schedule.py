"""Pipeline schedules as data: the single description of op order per stage.

megatron-core's non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``)
executes exactly the order produced here; the iteration simulator walks this description and a
live test asserts the order recorded by the schedule hooks equals it. For the interleaved schedule
(``forward_backward_pipelining_with_interleaving``) it says which micro-batch counts a replica can
run (``interleaved_runs``); its op order is not described yet. Nothing here
executes ops.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Op:
    """One forward or backward of one micro-batch on one stage."""

    kind: OpKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"


StageOps = tuple[Op, ...]
Schedule = tuple[StageOps, ...]


def num_warmup_microbatches(num_stages: int, stage: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward under 1F1B."""
    return min(num_stages - stage - 1, num_microbatches)


# Immutable, and asked for once per replica per judged iteration (128 times an iteration at 4,096
# ranks) with the same few shapes.
@functools.lru_cache(maxsize=256)
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """The non-interleaved 1F1B schedule, one op list per pipeline stage.

    Stage ``s`` runs ``w = min(P - s - 1, M)`` warm-up forwards, then alternates the forward of
    micro-batch ``w + i`` with the backward of micro-batch ``i``, then drains the remaining
    backwards. With ``P == 1`` this degenerates to F0 B0 F1 B1 ..., which is also the order of
    megatron-core's no-pipelining schedule.

    Args:
        num_stages: pipeline-parallel degree P (>= 1).
        num_microbatches: micro-batches M this replica runs in the iteration (>= 0).

    Returns:
        A tuple of per-stage op tuples.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    stages = []
    for stage in range(num_stages):
        warmup = num_warmup_microbatches(num_stages, stage, num_microbatches)
        ops = [Op(OpKind.FORWARD, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops.append(Op(OpKind.FORWARD, warmup + i))
            ops.append(Op(OpKind.BACKWARD, i))
        ops.extend(Op(OpKind.BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches))
        stages.append(tuple(ops))
    return tuple(stages)


def interleaved_runs(num_microbatches: int, num_stages: int, group_size: int) -> bool:
    """Whether megatron-core's interleaved schedule runs ``num_microbatches`` on a replica of
    ``num_stages`` stages: it takes micro-batches in groups of ``group_size`` (at least
    ``num_stages``; megatron-core's default is ``num_stages``) through each model chunk, and refuses a
    count below one group, or whose last group holds fewer than ``num_stages``."""
    rest = num_microbatches % group_size
    return num_microbatches >= group_size and (rest == 0 or rest >= num_stages)
