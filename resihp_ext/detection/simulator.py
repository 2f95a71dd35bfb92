"""Iteration-time prediction: the longest path through a pipeline schedule's dependency DAG.

Responsible for turning per-op durations (seconds per forward/backward of each micro-batch on each
stage) plus transfer and gradient-sync costs into the time one DP replica needs for one
iteration, by walking the schedule description in ``resihp_ext.schedule`` (never a second
encoding of it). It must never execute ops, read clocks or import ``torch.distributed``: it is
called inside the planner's search and by the detector, on plain numbers.

DAG edges, over virtual stages ``v = c P + s`` (chunk ``c`` of stage ``s``; ``v = s`` without the
interleaved schedule):
    * program order within a stage (a stage runs one op at a time, in schedule order);
    * ``F(v, m) -> F(v+1, m)`` plus the one-way transfer between their stages (activations);
    * ``B(v+1, m) -> B(v, m)`` plus the same transfer (gradients);
    * ``F(last, m) -> B(last, m)`` (the loss needs the last forward).
Each stage then spends ``allreduce_s`` on data-parallel gradient sync after its last op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from resihp_ext.schedule import OpKind, Schedule, pipeline_schedule


@dataclass(frozen=True, slots=True)
class IterationPrediction:
    """Predicted timing of one iteration of one replica.

    Attributes:
        total_s: iteration time: the latest stage finish, gradient sync included.
        stage_finish_s: per stage, end of its last op plus its gradient sync.
        op_finish_s: per stage, finish time of each op in schedule order (None if not kept).
    """

    total_s: float
    stage_finish_s: tuple[float, ...]
    op_finish_s: tuple[tuple[float, ...], ...] | None = None


def _per_boundary(p2p_s: float | Sequence[float], num_stages: int) -> list[float]:
    if np.isscalar(p2p_s):
        value = float(p2p_s)
        if value < 0:
            raise ValueError(f"p2p_s must be >= 0 seconds, got {value}")
        return [value] * max(num_stages - 1, 0)
    values = [float(x) for x in p2p_s]
    if len(values) != num_stages - 1:
        raise ValueError(
            f"p2p_s must be a float or one value per stage boundary ({num_stages - 1}), got {len(values)}"
        )
    if any(v < 0 for v in values):
        raise ValueError(f"p2p_s must be >= 0 seconds, got {values}")
    return values


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    if np.isscalar(value):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in value]
        if len(values) != num_stages:
            raise ValueError(f"{name} must be a float or one value per stage ({num_stages}), got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must be >= 0 seconds, got {values}")
    return values


def _durations(table, num_stages: int, num_microbatches: int, name: str) -> list[list[float]]:
    rows = [list(map(float, row)) for row in table]
    if len(rows) != num_stages or any(len(r) < num_microbatches for r in rows):
        raise ValueError(
            f"{name} must be indexed [stage][microbatch] with {num_stages} stages and "
            f">= {num_microbatches} micro-batches each"
        )
    return rows


def simulate_iteration(
    schedule: Schedule,
    forward_s,
    backward_s,
    p2p_s: float | Sequence[float] = 0.0,
    allreduce_s: float | Sequence[float] = 0.0,
    keep_ops: bool = True,
) -> IterationPrediction:
    """Predict one replica's iteration time as the longest path through the schedule's DAG.

    Args:
        schedule: per-stage op tuples, e.g. ``one_f_one_b(num_stages, num_microbatches)`` or
            ``interleaved(...)``.
        forward_s: ``forward_s[stage][k]`` seconds of the stage's ``k``-th forward (nested
            sequences or a 2-D array): under 1F1B micro-batch ``k``'s, under the interleaved
            schedule virtual micro-batch ``k``'s (what the timing hooks record in that place).
        backward_s: ``backward_s[stage][k]``, likewise for the ``k``-th backward.
        p2p_s: one-way transfer seconds, a float or one value per boundary (``num_stages - 1``);
            boundary ``s`` sits between stages ``s`` and ``s + 1``. Under the interleaved schedule
            the transfer from the last stage back to the first (from one chunk to the next) is
            not measured on its own; it is priced as the mean boundary's.
        allreduce_s: gradient-sync seconds after each stage's last op (float or per stage). It is
            charged even to a stage with no ops: the replica still joins the collective.
        keep_ops: also return every op's finish time (slightly slower).

    Returns:
        An ``IterationPrediction``.

    Raises:
        ValueError: on mis-shaped inputs, negative times, or a schedule whose dependencies cannot
            be satisfied (a deadlocked op order).
    """
    num_stages = len(schedule)
    if num_stages < 1:
        raise ValueError("schedule must have at least one stage; build it with one_f_one_b(P, M)")
    num_microbatches = 1 + max((op.microbatch for ops in schedule for op in ops), default=-1)
    num_chunks = 1 + max((op.chunk for op in schedule[0]), default=0)  # every stage runs every chunk
    columns = num_microbatches if num_chunks == 1 else \
        max(sum(op.kind is OpKind.FORWARD for op in ops) for ops in schedule)
    fwd = _durations(forward_s, num_stages, columns, "forward_s")
    bwd = _durations(backward_s, num_stages, columns, "backward_s")
    link = _per_boundary(p2p_s, num_stages)
    # index v of the virtual stage before v = c P + s: boundary s - 1, or the wrap from the last stage
    link.append(sum(link) / len(link) if link and num_chunks > 1 else 0.0)
    sync = _per_stage(allreduce_s, num_stages, "allreduce_s")

    # Per-stage flattened ops, to keep enum lookups and index arithmetic out of the loop: whether
    # each is a forward, its micro-batch, and under the interleaved schedule its virtual stage and
    # its column (its place among its kind); without it those are the stage and the micro-batch.
    kinds = [[op.kind is OpKind.FORWARD for op in ops] for ops in schedule]
    mbs = [[op.microbatch for op in ops] for ops in schedule]
    virtual = columns_of = None
    if num_chunks > 1:
        virtual = [[op.chunk * num_stages + s for op in ops] for s, ops in enumerate(schedule)]
        columns_of = []
        for row in kinds:
            seen, places = [0, 0], []
            for forward in row:
                places.append(seen[forward])
                seen[forward] += 1
            columns_of.append(places)
    nan = float("nan")
    num_virtual = num_chunks * num_stages
    f_end = [[nan] * num_microbatches for _ in range(num_virtual)]
    b_end = [[nan] * num_microbatches for _ in range(num_virtual)]
    op_end = [[0.0] * len(ops) for ops in schedule] if keep_ops else None
    ptr = [0] * num_stages
    clock = [0.0] * num_stages
    last_virtual = num_virtual - 1

    # Work-list over stages: advance a stage as far as its dependencies allow; finishing an op can
    # only unblock the stage it feeds (the next one, or the first after the last one's forward of
    # a chunk; backwards the other way), so each op is visited O(1) times.
    pending = list(range(num_stages - 1, -1, -1))
    while pending:
        s = pending.pop()
        ops_kind, ops_mb = kinds[s], mbs[s]
        ops_v = None if virtual is None else virtual[s]
        ops_col = ops_mb if columns_of is None else columns_of[s]
        n = len(ops_kind)
        i = ptr[s]
        t = clock[s]
        advanced_f = advanced_b = False
        while i < n:
            m, k = ops_mb[i], ops_col[i]
            v = s if ops_v is None else ops_v[i]
            if ops_kind[i]:
                if v > 0:
                    dep = f_end[v - 1][m]
                    if dep != dep:  # NaN: upstream forward not done yet
                        break
                    dep += link[s - 1]
                    if dep > t:
                        t = dep
                t += fwd[s][k]
                f_end[v][m] = t
                advanced_f = True
            else:
                if v < last_virtual:
                    dep = b_end[v + 1][m]
                    if dep != dep:
                        break
                    dep += link[s if s < num_stages - 1 else -1]
                else:
                    dep = f_end[v][m]
                    if dep != dep:
                        break
                if dep > t:
                    t = dep
                t += bwd[s][k]
                b_end[v][m] = t
                advanced_b = True
            if op_end is not None:
                op_end[s][i] = t
            i += 1
        ptr[s] = i
        clock[s] = t
        if advanced_f and (s < num_stages - 1 or num_chunks > 1):
            pending.append((s + 1) % num_stages)
        if advanced_b and (s > 0 or num_chunks > 1):
            pending.append((s - 1) % num_stages)

    stuck = [s for s in range(num_stages) if ptr[s] < len(kinds[s])]
    if stuck:
        raise ValueError(
            f"schedule deadlocks: stages {stuck} wait on ops that never run; "
            "build the schedule with resihp_ext.schedule.one_f_one_b or interleaved"
        )
    finish = tuple(clock[s] + sync[s] for s in range(num_stages))
    return IterationPrediction(
        total_s=max(finish),
        stage_finish_s=finish,
        op_finish_s=tuple(tuple(row) for row in op_end) if op_end is not None else None,
    )


def pipeline_time_s(
    num_stages: int,
    num_microbatches: int,
    stage_forward_s: float | Sequence[float],
    stage_backward_s: float | Sequence[float],
    p2p_s: float | Sequence[float] = 0.0,
    num_chunks: int = 1,
    group_size: int | None = None,
    chunk_shares: Sequence[Sequence[float]] | None = None,
) -> float:
    """1F1B iteration time when every micro-batch costs the same on a given stage.

    With ``num_chunks`` above 1, the interleaved schedule's time (``resihp_ext.schedule.interleaved``,
    micro-batches in groups of ``group_size``, default ``num_stages``), each chunk's op taking an
    equal share of the stage's time per micro-batch, or ``chunk_shares[s][c]`` of stage ``s``'s
    time for chunk ``c`` (chunks of unequal size, after layers moved between stages).

    Equal to ``simulate_iteration(one_f_one_b(P, M), ...)`` with each stage's time repeated over
    micro-batches (a unit test checks this). Identical stages without transfer cost use the closed
    form ``(M + P - 1) * (f + b)``; otherwise the exact walk runs once per distinct input and is
    memoised, since a planner's search revisits the same stage costs many times.

    Args:
        num_stages: pipeline degree P (>= 1).
        num_microbatches: micro-batches M (>= 0).
        stage_forward_s: forward seconds per micro-batch, a float or one per stage.
        stage_backward_s: backward seconds per micro-batch, a float or one per stage.
        p2p_s: one-way transfer seconds, a float or one per boundary.

    Returns:
        Iteration seconds (no gradient sync).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    fwd = tuple(_per_stage(stage_forward_s, num_stages, "stage_forward_s"))
    bwd = tuple(_per_stage(stage_backward_s, num_stages, "stage_backward_s"))
    link = tuple(_per_boundary(p2p_s, num_stages))
    if num_microbatches == 0:
        return 0.0
    if num_chunks == 1 and len(set(fwd)) == 1 and len(set(bwd)) == 1 and all(v == 0.0 for v in link):
        return (num_microbatches + num_stages - 1) * (fwd[0] + bwd[0])
    shares = None
    if chunk_shares is not None and num_chunks > 1:
        shares = tuple(tuple(float(x) for x in row) for row in chunk_shares)
        if len(shares) != num_stages or any(len(row) != num_chunks for row in shares):
            raise ValueError(f"chunk_shares must give each of {num_stages} stages {num_chunks} shares, got {shares}")
    return _walk_uniform(num_stages, num_microbatches, fwd, bwd, link, num_chunks, group_size or num_stages, shares)


@functools.lru_cache(maxsize=65536)
def _walk_uniform(num_stages, num_microbatches, fwd, bwd, link, num_chunks, group_size, shares=None) -> float:
    schedule = pipeline_schedule(num_stages, num_microbatches, num_chunks, group_size)
    if shares is None:
        columns = num_chunks * num_microbatches
        table_f = [[f / num_chunks] * columns for f in fwd]
        table_b = [[b / num_chunks] * columns for b in bwd]
    else:  # each op column is one chunk's op: its share of the stage's time
        table_f = [[fwd[s] * shares[s][op.chunk] for op in ops if op.kind is OpKind.FORWARD]
                   for s, ops in enumerate(schedule)]
        table_b = [[bwd[s] * shares[s][op.chunk] for op in ops if op.kind is OpKind.BACKWARD]
                   for s, ops in enumerate(schedule)]
    return simulate_iteration(schedule, table_f, table_b, list(link), keep_ops=False).total_s
