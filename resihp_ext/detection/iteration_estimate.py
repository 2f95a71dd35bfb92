"""What a whole iteration should take: the iteration predictor the detector reports.

Responsible for turning the micro-batch predictor's per-op busy seconds into an iteration's wall
time. Each replica's schedule (1F1B, or the interleaved one) is simulated (``predict_replica``): its ops are scaled from busy
to wall seconds by the recent contention (1 on a dedicated device, more where ranks share CPU
cores), and its pipeline transfers take their healthy baselines. The work outside the schedule (DP
gradient sync, optimizer step) is added as the median residual of recent healthy iterations.

Pure: the detector passes the predictor, the groups, their levels and the transfer baselines in.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable, Mapping

import numpy as np

from resihp_ext.detection.observations import GroupId
from resihp_ext.detection.predictor import MicrobatchPredictor, predict_replica
from resihp_ext.schedule import Interleaving

# Healthy iterations the overhead and contention estimates need before they are trusted.
_SETTLED = 3


class IterationEstimate:
    """Recent healthy iterations' contention and overhead, and the prediction built on them.

    Args:
        history: healthy iterations remembered.
    """

    def __init__(self, history: int) -> None:
        self._overhead_s: deque = deque(maxlen=history)
        self._contention: deque = deque(maxlen=history)

    def typical_contention(self, current: float) -> float:
        """Wall seconds per busy second of ops, the median over recent healthy iterations
        (``current`` until there is one)."""
        return statistics.median(self._contention) if self._contention else current

    def predict(
        self,
        predictor: MicrobatchPredictor,
        keys: Mapping[GroupId, tuple[Hashable, Hashable]],
        feats: Mapping[int, np.ndarray],
        level: Callable[[GroupId], float],
        transfer_s: Callable[[GroupId, GroupId], float],
        observed_s: float,
        contention: float,
        threshold: float,
        interleaving: Interleaving = Interleaving(),
    ) -> float | None:
        """The iteration's predicted wall seconds, or None when a replica misses a stage.

        Learns from the iteration (its overhead residual and contention) unless it ran more than
        ``threshold`` times the prediction, so a slow iteration never becomes the norm.

        Args:
            keys: per group ``(replica, stage)`` its predictor keys (forward, backward).
            feats: per replica, its op columns' features (``predict_replica``).
            level: a group's speed level (``SpeedLevels.level``).
            transfer_s: the healthy seconds of one transfer from a stage group to the next.
            observed_s: the iteration's observed wall seconds.
            contention: this iteration's wall seconds per busy second over all ops.
            interleaving: the replicas' schedule.
        """
        scale = self.typical_contention(contention)
        spans = []
        by_replica: dict[int, list[int]] = {}
        for r, s in keys:
            by_replica.setdefault(r, []).append(s)
        for r in sorted(by_replica):
            stages = sorted(by_replica[r])
            if stages != list(range(len(stages))):
                return None  # a replica with missing stages cannot be simulated
            p2p = [transfer_s((r, s), (r, s + 1)) for s in stages[:-1]]
            pred = predict_replica(predictor, [keys[(r, s)] for s in stages], feats[r], p2p,
                                   op_scale=[scale * level((r, s)) for s in stages], interleaving=interleaving)
            spans.append(pred.total_s)
        span = max(spans)
        overhead = statistics.median(self._overhead_s) if self._overhead_s else 0.0
        settled = len(self._overhead_s) >= _SETTLED  # before that the estimate itself is unknown
        if not settled or observed_s / max(span + overhead, 1e-12) <= threshold:
            self._overhead_s.append(max(observed_s - span, 0.0))
            self._contention.append(contention)
        return span + overhead
