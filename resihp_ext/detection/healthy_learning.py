"""Teaching the cost models from the stage groups an iteration found healthy.

Responsible for turning those groups' op durations into the predictor's rows (tokens, sum of
squared document lengths, documents, seconds, speed level) and for updating each group's speed
level from the predictions made before the iteration. Which groups are healthy is the detector's
judgement: a suspect group teaches nothing, so a persistent slowdown never becomes the norm.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from resihp_ext.detection.observations import GroupId
from resihp_ext.detection.predictor import MicrobatchPredictor
from resihp_ext.detection.speed_level import SpeedLevels


def learn_from_healthy(
    predictor: MicrobatchPredictor,
    levels: SpeedLevels,
    healthy: Iterable[GroupId],
    durations: Mapping[GroupId, tuple[np.ndarray, np.ndarray]],
    keys: Mapping[GroupId, tuple[Hashable, Hashable]],
    features: Mapping[int, np.ndarray],
    op_predicted: Mapping[GroupId, Sequence[np.ndarray] | None],
) -> None:
    """Learn from the ``healthy`` groups' forward and backward op seconds (``durations``).

    Each group's ops were run at its current speed level, so the level goes with every row and the
    predictor fits the device's healthy cost under it; the level then learns from how far this
    iteration's ops stood from ``op_predicted`` (None for a group not yet predicted).
    ``features`` are per replica, since every stage of a replica runs the same micro-batches.
    """
    batches: dict = defaultdict(list)
    for g in healthy:
        fwd, bwd = durations[g]
        level = levels.level(g)
        for key, seconds in zip(keys[g], (fwd, bwd)):
            batches[key].append(np.column_stack([features[g[0]], seconds, np.full(len(seconds), level)]))
        if op_predicted[g] is not None:
            levels.update(g, np.concatenate([fwd, bwd]), np.concatenate(op_predicted[g]))
    for key, parts in batches.items():
        data = np.concatenate(parts)  # columns: tokens, sum_sq, documents, seconds, speed level
        data = data[np.isfinite(data[:, 3]) & (data[:, 3] > 0)]
        if len(data):
            predictor.observe_batch(key, data[:, 0], data[:, 1], data[:, 3], num_docs=data[:, 2], scale=data[:, 4])
