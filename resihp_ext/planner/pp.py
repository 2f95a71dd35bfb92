"""PP layer repartition: an exact contiguous split of layers over a pipeline's stages.

Responsible for choosing how many consecutive layers each stage holds so that the slowest
stage's time is minimal, given each stage's seconds per unit of work, per-layer work, the extra
work of the first (embedding) and last (output layer + loss) stages, and per-stage memory caps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Partition:
    """Layers per stage and the resulting slowest-stage time (in the caller's units)."""

    layers_per_stage: tuple[int, ...]
    bottleneck: float


def stage_times(
    layers_per_stage: Sequence[int],
    layer_costs: Sequence[float],
    s_per_cost: Sequence[float],
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> tuple[float, ...]:
    """Time of each stage under a given split: ``s_per_cost[p] * (its layer work + extra)``."""
    out, start, num_stages = [], 0, len(layers_per_stage)
    for p, num in enumerate(layers_per_stage):
        work = float(sum(layer_costs[start:start + num]))
        work += (first_extra if p == 0 else 0.0) + (last_extra if p == num_stages - 1 else 0.0)
        out.append(s_per_cost[p] * work)
        start += num
    return tuple(out)


def partition_layers(
    layer_costs: Sequence[float],
    s_per_cost: Sequence[float],
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    max_layers: Sequence[int] | None = None,
    prefer: Sequence[int] | None = None,
) -> Partition | None:
    """Minimise the slowest stage's time over all contiguous splits (each stage >= 1 layer).

    Exact by dynamic programming: ``best[p][j]`` is the least achievable slowest-stage time when
    stages ``0..p`` hold layers ``[0, j)``; ``best[p][j] = min_i max(best[p-1][i], t_p(i, j))``
    over ``i`` with ``1 <= j - i <= max_layers[p]``. Every split is one path through this table,
    so the minimum over paths is the optimum (O(P * L^2), vectorised per stage).

    Args:
        layer_costs: work of each layer (e.g. seconds at TP=1, speed 1).
        s_per_cost: per stage, seconds per unit of work (1 / effective speed).
        first_extra: extra work of stage 0 (embedding).
        last_extra: extra work of the last stage (output layer + loss).
        max_layers: per stage, most layers that fit in memory (None: unlimited).
        prefer: a split returned instead of the DP's when it is equally good (fewer moves).

    Returns:
        The optimal Partition, or None when no split respects the caps.
    """
    num_layers, num_stages = len(layer_costs), len(s_per_cost)
    if num_stages < 1 or num_layers < num_stages:
        return None
    caps = list(max_layers) if max_layers is not None else [num_layers] * num_stages
    if len(caps) != num_stages:
        raise ValueError(f"max_layers has {len(caps)} entries, expected one per stage ({num_stages})")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(layer_costs, dtype=float))])
    span = prefix[None, :] - prefix[:, None]  # span[i, j] = work of layers [i, j)
    count = np.arange(num_layers + 1)[None, :] - np.arange(num_layers + 1)[:, None]
    best = np.full(num_layers + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((num_stages, num_layers + 1), dtype=int)
    for p in range(num_stages):
        extra = (first_extra if p == 0 else 0.0) + (last_extra if p == num_stages - 1 else 0.0)
        cost = s_per_cost[p] * (span + extra)
        ok = (count >= 1) & (count <= caps[p])
        cand = np.where(ok, np.maximum(best[:, None], cost), np.inf)
        choice[p] = np.argmin(cand, axis=0)
        best = cand[choice[p], np.arange(num_layers + 1)]
    optimum = float(best[num_layers])
    if not np.isfinite(optimum):
        return None
    if prefer is not None and len(prefer) == num_stages and sum(prefer) == num_layers and all(
            1 <= n <= c for n, c in zip(prefer, caps)):
        kept = max(stage_times(prefer, layer_costs, s_per_cost, first_extra, last_extra))
        if kept <= optimum * (1.0 + 1e-9):
            return Partition(tuple(int(n) for n in prefer), kept)
    split, end = [], num_layers
    for p in range(num_stages - 1, -1, -1):
        start = int(choice[p][end])
        split.append(end - start)
        end = start
    return Partition(tuple(reversed(split)), optimum)
