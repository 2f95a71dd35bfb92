"""How well a run's op times repeat when the work is the same: the floor under any cost model.

Responsible for grouping a trace's forward and backward ops by the work they did (pipeline stage,
op kind, and the micro-batch's features: tokens, sum of squared document lengths, documents) and
measuring how far each op's time lies from its group's median. No model that sees only the
features can predict those ops better than that spread, so a predictor's MAPE is read against it.

Why a same-run measure: the spread depends on the host's load while the run ran (eight ranks
sharing two cores change each other's cache and memory bandwidth), so a floor measured at another
moment, or by another process, says little about the run being judged.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from resihp_ext.detection.observations import RankObservation


@dataclass(frozen=True, slots=True)
class SameWorkSpread:
    """Attributes:
        mape_pct: mean absolute deviation of each op's time from its group's median, in percent
            of that median.
        groups: groups of identical work with at least ``min_repeats`` ops.
        ops: ops in those groups.
    """

    mape_pct: float
    groups: int
    ops: int


def same_work_spread(
    iterations: Iterable[tuple[int, Iterable[RankObservation]]],
    min_repeats: int = 8,
    first_iteration: int = 2,
    last_iteration: int | None = None,
) -> SameWorkSpread | None:
    """Spread of op times over ops that did identical work.

    Args:
        iterations: (iteration, observations of every rank in it).
        min_repeats: groups with fewer ops are left out (their median is no reference).
        first_iteration, last_iteration: the healthy window to read (inclusive); by default from
            iteration 2, since the first iteration after a start warms caches and allocators.

    Returns:
        The spread, or None when no group has ``min_repeats`` ops.
    """
    if min_repeats < 2:
        raise ValueError(f"min_repeats must be >= 2 (a median of one op is the op), got {min_repeats}")
    times: dict[tuple, list[float]] = defaultdict(list)
    for iteration, observations in iterations:
        if iteration < first_iteration or (last_iteration is not None and iteration > last_iteration):
            continue
        for obs in observations:
            busy = obs.busy or tuple(end - start for _, _, start, end in obs.ops)
            for (kind, mb, _, _), seconds in zip(obs.ops, busy):
                times[(obs.stage, kind, tuple(obs.features[mb]))].append(seconds)
    deviations = []
    groups = 0
    for group in times.values():
        if len(group) < min_repeats:
            continue
        median = statistics.median(group)
        if median <= 0:
            continue
        groups += 1
        deviations += [abs(t - median) / median for t in group]
    if not deviations:
        return None
    return SameWorkSpread(mape_pct=100.0 * statistics.fmean(deviations), groups=groups, ops=len(deviations))
