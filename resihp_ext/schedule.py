"""Pipeline schedules as data: the single description of op order per stage.

megatron-core's non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``)
and its interleaved one (``forward_backward_pipelining_with_interleaving``) execute exactly the
orders produced here (``one_f_one_b``, ``interleaved``); the iteration simulator walks this
description and live tests assert the order recorded by the schedule hooks equals it. For the
interleaved schedule it also says which micro-batch counts a replica can run (``interleaved_runs``).
Nothing here executes ops.

Under the interleaved schedule each stage holds ``V`` model chunks, and virtual stage ``c P + s``
(chunk ``c`` of stage ``s``) runs a contiguous share of the layers: a micro-batch crosses every
stage ``V`` times. The schedule runs a stage's forwards in *virtual micro-batch* order: micro-batches
go in groups of ``G`` through chunk 0, then the same group through chunk 1, and so on
(``virtual_microbatches``); the ``k``-th backward runs the ``k``-th virtual micro-batch's
micro-batch through the chunks in reverse. Every stage shares that numbering, which is what the
timing hooks record (the ``k``-th forward or backward of a kind) and what the detector's op tables
are indexed by.
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
    """One forward or backward of one micro-batch through one model chunk of one stage (chunk 0
    without the interleaved schedule)."""

    kind: OpKind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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


# Read for every observation the decider gathers, with the same few shapes.
@functools.lru_cache(maxsize=256)
def virtual_microbatches(num_microbatches: int, num_chunks: int, group_size: int) -> tuple[tuple[int, int], ...]:
    """The interleaved schedule's forward order on every stage: ``(micro-batch, chunk)`` of each
    virtual micro-batch. Micro-batches go in groups of ``group_size`` through chunk 0, then chunk 1,
    ...; the last group holds the micro-batches left (``interleaved_runs`` says how few it may)."""
    if num_chunks < 1 or group_size < 1:
        raise ValueError(f"num_chunks and group_size must be >= 1, got {num_chunks} and {group_size}")
    order = []
    first = 0
    while first < num_microbatches:
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        order.extend((m, c) for c in range(num_chunks) for m in range(first, last))
        first = last
    return tuple(order)


def interleaved_warmup(num_stages: int, stage: int, num_chunks: int, group_size: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward under the interleaved schedule: two per
    later stage, so that each of them holds one to run while the other's activation is in flight,
    plus one group through every chunk but the last; at most every virtual micro-batch."""
    warmup = 2 * (num_stages - stage - 1) + (num_chunks - 1) * group_size
    return min(warmup, num_chunks * num_microbatches)


@functools.lru_cache(maxsize=256)
def interleaved(num_stages: int, num_chunks: int, num_microbatches: int, group_size: int) -> Schedule:
    """megatron-core's interleaved schedule, one op list per pipeline stage.

    Over a stage's ``V M`` virtual micro-batches it is 1F1B with a longer warm-up
    (``interleaved_warmup``): the warm-up's forwards, then the forward of virtual micro-batch
    ``w + i`` beside the backward of virtual micro-batch ``i``, then the remaining backwards. The
    ``k``-th forward runs ``virtual_microbatches(...)[k]``; the ``k``-th backward runs the same
    micro-batch through chunk ``V - 1 - c``, the chunks in reverse.

    Args:
        num_stages: pipeline-parallel degree P (>= 2: megatron-core interleaves pipelines only).
        num_chunks: model chunks V per stage (>= 1; 1 gives ``one_f_one_b``).
        num_microbatches: micro-batches M this replica runs (one the schedule runs: ``interleaved_runs``).
        group_size: micro-batches G a group takes through each chunk (megatron-core's
            ``microbatch_group_size_per_vp_stage``, P by default).

    Returns:
        A tuple of per-stage op tuples.
    """
    if num_chunks == 1:
        return one_f_one_b(num_stages, num_microbatches)
    if num_stages < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 stages, got {num_stages}")
    if not interleaved_runs(num_microbatches, num_stages, group_size):
        raise ValueError(f"the interleaved schedule does not run {num_microbatches} micro-batches on "
                         f"{num_stages} stages in groups of {group_size} (interleaved_runs)")
    table = virtual_microbatches(num_microbatches, num_chunks, group_size)
    forward = [Op(OpKind.FORWARD, m, c) for m, c in table]
    backward = [Op(OpKind.BACKWARD, m, num_chunks - 1 - c) for m, c in table]
    stages = []
    total = len(table)
    for stage in range(num_stages):
        warmup = interleaved_warmup(num_stages, stage, num_chunks, group_size, num_microbatches)
        ops = forward[:warmup]
        for i in range(total - warmup):
            ops += [forward[warmup + i], backward[i]]
        ops += backward[total - warmup:]
        stages.append(tuple(ops))
    return tuple(stages)


def pipeline_schedule(num_stages: int, num_microbatches: int, num_chunks: int = 1,
                      group_size: int | None = None) -> Schedule:
    """The schedule megatron-core runs for a replica: 1F1B with one model chunk per stage, the
    interleaved one with more (``group_size`` defaulting to ``num_stages``, as megatron-core's)."""
    if num_chunks == 1:
        return one_f_one_b(num_stages, num_microbatches)
    return interleaved(num_stages, num_chunks, num_microbatches, group_size or num_stages)


@dataclass(frozen=True)
class Interleaving:
    """How a job's replicas run their pipeline: ``num_chunks`` model chunks per stage (1: 1F1B),
    micro-batches in groups of ``group_size`` through each (None: the pipeline's size, as
    megatron-core's default). The detector and the planner read op timings and price plans by it.

    Op timings come in *columns*, one per forward (and backward) a stage runs: ``num_chunks``
    per micro-batch, in virtual micro-batch order.
    """

    num_chunks: int = 1
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_chunks < 1 or (self.group_size is not None and self.group_size < 1):
            raise ValueError(f"num_chunks and group_size must be >= 1, got {self.num_chunks} and {self.group_size}")

    def schedule(self, num_stages: int, num_microbatches: int) -> Schedule:
        return pipeline_schedule(num_stages, num_microbatches, self.num_chunks, self.group_size)

    def microbatches(self, columns: int) -> int:
        """Micro-batches behind ``columns`` op columns."""
        if columns % self.num_chunks:
            raise ValueError(f"{columns} op columns are not {self.num_chunks} per micro-batch")
        return columns // self.num_chunks

    def column_microbatch(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        """Each op column's micro-batch (forwards and backwards alike: the ``k``-th backward runs
        the ``k``-th forward's micro-batch)."""
        if self.num_chunks == 1:
            return tuple(range(num_microbatches))
        return tuple(m for m, _ in virtual_microbatches(num_microbatches, self.num_chunks,
                                                        self.group_size or num_stages))


def interleaved_runs(num_microbatches: int, num_stages: int, group_size: int) -> bool:
    """Whether megatron-core's interleaved schedule runs ``num_microbatches`` on a replica of
    ``num_stages`` stages: it takes micro-batches in groups of ``group_size`` (at least
    ``num_stages``; megatron-core's default is ``num_stages``) through each model chunk, and refuses a
    count below one group, or whose last group holds fewer than ``num_stages``."""
    rest = num_microbatches % group_size
    return num_microbatches >= group_size and (rest == 0 or rest >= num_stages)
