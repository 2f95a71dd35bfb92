"""Each stage group's recent speed relative to its cost model.

Responsible for one multiplier per stage group (the TP ranks of one stage of one replica) that
says how much slower or faster than the fitted micro-batch model the group has run over its
recent healthy iterations. The prediction for the group's next iteration is the model times this
level. It exists for two reasons measured on live runs (``docs/notes/benchmarks.md`` section 21):

* a device's speed drifts: on a shared host each vCPU runs a few % slower or faster for tens of
  seconds at a time, each on its own, and GPUs do the same as their clocks follow temperature and
  power; a model fitted over the whole run predicts the average speed, not the current one;
* op-time noise is skewed: interference only adds time, so the least-squares fit (a mean) sits
  above the typical op, and a relative error is smallest around the median.

The level is the exponentially weighted mean of each healthy iteration's median log ratio of
observed to predicted op time, and it is clamped to ``[1 / (1 + max_drift), 1 + max_drift]``.
The clamp is what keeps detection sound: a fail-slow can move the level by at most
``max_drift`` (and suspect iterations are never fed in at all), so a slowdown of ``f`` still
shows as a ratio of at least ``f / (1 + max_drift)``.

It must never decide what is healthy (the caller feeds only iterations it learns from) and never
read clocks, files or process groups.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable

import numpy as np


class SpeedLevels:
    """Clamped, exponentially weighted speed level per group.

    Args:
        halflife_iters: healthy iterations after which an observation's weight has halved;
            0 turns levels off (every level stays 1).
        max_drift: largest relative drift a level may follow (0.05: within 5% of the model).
    """

    def __init__(self, halflife_iters: float = 2.0, max_drift: float = 0.05) -> None:
        if halflife_iters < 0:
            raise ValueError(f"halflife_iters must be >= 0 (0 turns levels off), got {halflife_iters}")
        if not 0.0 <= max_drift < 1.0:
            raise ValueError(f"max_drift must be in [0, 1), got {max_drift}")
        self.halflife_iters = halflife_iters
        self.max_drift = max_drift
        self._weight = 1.0 - 0.5 ** (1.0 / halflife_iters) if halflife_iters > 0 else 0.0
        self._bound = math.log1p(max_drift)
        self._log_level: dict[Hashable, float] = {}

    @property
    def enabled(self) -> bool:
        return self._weight > 0.0 and self._bound > 0.0

    def level(self, group: Hashable) -> float:
        """The multiplier on the model's prediction for ``group`` (1 for a group never fed)."""
        return math.exp(self._log_level.get(group, 0.0))

    def update(self, group: Hashable, observed_s, predicted_s) -> float:
        """Feed one healthy iteration of ``group``: its ops' observed seconds and the seconds the
        group was predicted (model times the current level). Returns the new level.

        The median over the iteration's ops, so one op that an interrupt stretched moves nothing.
        """
        if not self.enabled:
            return 1.0
        observed = np.asarray(observed_s, dtype=float)
        predicted = np.asarray(predicted_s, dtype=float)
        ok = np.isfinite(observed) & np.isfinite(predicted) & (observed > 0) & (predicted > 0)
        if not ok.any():
            return self.level(group)
        step = statistics.median(np.log(observed[ok] / predicted[ok]).tolist())  # a few values: no numpy median
        log_level = self._log_level.get(group, 0.0) + self._weight * step
        self._log_level[group] = min(max(log_level, -self._bound), self._bound)
        return self.level(group)

    def reset(self) -> None:
        """Forget every level (a re-plan: new groups, new cost models)."""
        self._log_level.clear()
