"""The planner's compute costs, fitted to one measured iteration of this job.

Responsible for ``ComputeCosts``: per-layer forward seconds, the output layer + loss, and the
backward/forward ratio, read from every rank's recorded ops of one iteration and the layout they
ran on. The numbers are per layer at TP 1, so they outlive a change of layout: a plan made after a
re-plan or a failure can use the last fit whatever layout measured it.

Only the rank that decides sees every rank's ops; the fit is what it hands the others (a few
numbers, however many ranks), so that every rank plans from the same costs.

One iteration's fit is noisy on a busy host: the output layer's cost is what the last stage spends
beyond its layers, a difference of two measured times, and over 34 iterations of 4 ranks on 2
cores it ranged from 0.0 to 3.8 ms around a typical 1.7 ms. A plan priced from such an outlier
took a 3x slow last stage for twice as costly as a 3x slow first stage and kept a skewed split.
``pooled_costs`` takes the median of each cost over the last ``FIT_WINDOW`` fits.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from resihp_ext.layout import Layout
from resihp_ext.detection.observations import RankObservation
from resihp_ext.detection.op_signals import op_tables
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.schedule import Interleaving

# Fits the pooled costs are the median of: enough that a few disturbed iterations move nothing,
# few enough that a lasting change of this job's speed shows within half of them.
FIT_WINDOW = 9


@dataclass(frozen=True)
class ComputeCosts:
    """Compute costs of this job, measured (device time, so a shared host's scheduling does not
    count as compute).

    Attributes:
        iteration: the iteration whose ops they were fitted to.
        layer_forward_s: forward seconds of one transformer layer for one micro-batch at TP 1.
        output_forward_s: forward seconds of the output layer + loss at TP 1; None when the job has
            one stage, where layers and output cannot be told apart (``layer_forward_s`` then
            carries the output's share, and the output is not charged again).
        backward_factor: backward seconds / forward seconds (median over ranks).
    """

    iteration: int
    layer_forward_s: float
    output_forward_s: float | None
    backward_factor: float

    def hardware(self, **facts) -> HardwareModel:
        """A ``HardwareModel`` with these costs and ``facts`` (memory, bandwidth, ...) beside them.

        TP efficiency is 1: the fit is per TP-1 layer from ranks that ran at their own TP degree,
        so what TP loses is already in it.
        """
        costs = dict(layer_forward_s=self.layer_forward_s, backward_factor=self.backward_factor,
                     include_embedding_cost=self.output_forward_s is not None, tp_efficiency=1.0)
        if self.output_forward_s is not None:
            costs["output_forward_s"] = self.output_forward_s
        return HardwareModel(**{**costs, **facts})

    def group_microbatch_s(self, layout: Layout) -> dict[tuple[int, int], float]:
        """What these costs price one micro-batch's forward and backward at, on each stage group
        ``(replica, stage)`` of ``layout`` (its layers, the output layer on a last stage, over its TP
        degree): how the planner priced the plan, per group."""
        out = {}
        for r, replica in enumerate(layout.replicas):
            last = len(replica.stages) - 1
            for s, stage in enumerate(replica.stages):
                forward = stage.num_layers * self.layer_forward_s
                if s == last and self.output_forward_s is not None:
                    forward += self.output_forward_s
                out[(r, s)] = forward * (1.0 + self.backward_factor) / stage.tp_degree
        return out


def per_microbatch_busy(observations: Sequence[RankObservation], layout: Layout, tables: np.ndarray,
                        interleaving: Interleaving) -> np.ndarray:
    """Each observation's busy seconds per micro-batch ``[observation, F | B, micro-batch]``: its op
    columns' under 1F1B, and under the interleaved schedule the sum of each micro-batch's chunk
    ops (a stage's layers are split over its chunks; the output layer sits in the last one)."""
    busy = tables[:, 4:6]
    if interleaving.num_chunks == 1:
        return busy
    folded = np.full((len(observations), 2, busy.shape[2] // interleaving.num_chunks), np.nan)
    for i, obs in enumerate(observations):
        count = interleaving.microbatches(len(obs.features))
        owner = np.array(interleaving.column_microbatch(len(layout.replicas[obs.replica].stages), count), dtype=int)
        columns = busy[i, :, :len(owner)]
        if not np.isfinite(columns).all():
            continue  # an op missing: no micro-batch of this rank is whole
        sums = np.zeros((2, count))
        np.add.at(sums, (slice(None), owner), columns)
        folded[i, :, :count] = sums
    return folded


def fit_compute_costs(iteration: int, observations: Sequence[RankObservation], layout: Layout,
                      tables: np.ndarray | None = None, interleaving: Interleaving = Interleaving(),
                      slow_factors: Mapping[int, float] | None = None) -> ComputeCosts | None:
    """Fit ``ComputeCosts`` to one iteration's observations, which ran on ``layout``.

    Per-layer forward seconds come from the healthiest stage that holds only transformer layers'
    work (not the last one); the output layer + loss from what the healthiest last stage spends
    beyond its layers. Each rank's op time is the median of its forwards (backwards), the upper
    one of an even count, so one disturbed micro-batch moves nothing. ``tables`` are the
    observations' ``op_tables`` when the caller has them (the detector built them already). Under
    the interleaved schedule an op is one chunk's, and a micro-batch's ops on a stage are summed
    first (``per_microbatch_busy``). ``slow_factors`` are the known steady slowdowns (rank ->
    factor, ``FailSlowDetector.expect``): a stage group holding such a rank is measured only where
    no group free of one is left (for the layers, or for the output), as the detector judges it:
    its slowest rank's times over the largest factor among its ranks, so the costs stay a healthy
    device's. Why only then: a TP sibling of a slow rank waits for it on a GPU and not on a CPU,
    so its own times tell nothing either way. Why at all: with every stage that holds only layers
    known slow (both first stages of a TP1 x PP2 x DP2 job), the per-layer cost came out at their
    pace, and every plan after it was priced at twice the healthy cost.

    Returns:
        The fit, or None when no rank ran both a forward and a backward.
    """
    if tables is None:
        tables = op_tables(observations)
    if not tables.size:  # no micro-batch anywhere
        return None
    busy = per_microbatch_busy(observations, layout, tables, interleaving)  # [observation, F | B, micro-batch]
    counts = np.isfinite(busy).sum(axis=2)
    # Sorted, NaN last: each observation's median op is at half its count of ops.
    medians = np.take_along_axis(np.sort(busy, axis=2), (counts // 2)[..., None], axis=2)[..., 0]
    group_factor: dict[tuple[int, int], float] = {}
    for obs in observations:
        key = (obs.replica, obs.stage)
        group_factor[key] = max(group_factor.get(key, 1.0), (slow_factors or {}).get(obs.rank, 1.0))
    free, slowed = ([], []), ([], [])  # (per layer, last stage): groups free of a known slowdown, and not
    slowest: dict[tuple[int, int], tuple[float, float]] = {}  # a known slow group's slowest rank: (f, b)
    ratios = []
    for obs, (f, b), (num_f, num_b) in zip(observations, medians.tolist(), counts.tolist()):
        if not (num_f and num_b):
            continue
        key = (obs.replica, obs.stage)
        if group_factor[key] > 1.0:
            slowest[key] = max(slowest.get(key, (f, b)), (f, b))
            continue
        _add(free, layout, key, f)
        ratios.append(b / f)
    for key, (f, b) in slowest.items():
        factor = group_factor[key]
        _add(slowed, layout, key, f / factor)
        ratios.append(b / f)
    if not ratios:
        return None
    # Groups with a known slow rank only where no other measured that part of the model.
    per_layer, last_stage = (part if part else other for part, other in zip(free, slowed))
    ratio = sorted(ratios)[len(ratios) // 2]
    if per_layer:
        layer_s = min(t / n for t, n in per_layer)
        output_s = min((max(t - n * layer_s, 0.0) for t, n in last_stage), default=0.0)
        return ComputeCosts(iteration, layer_s, output_s, ratio)
    return ComputeCosts(iteration, min(t / n for t, n in last_stage), None, ratio)


def _add(parts: tuple[list, list], layout: Layout, key: tuple[int, int], forward_s: float) -> None:
    """Add a stage group's forward seconds at TP 1, with its layer count, to ``parts`` (per layer,
    last stage), as its place in ``layout`` says."""
    replica = layout.replicas[key[0]]
    stage = replica.stages[key[1]]
    is_last = key[1] == len(replica.stages) - 1
    parts[1 if is_last else 0].append((forward_s * stage.tp_degree, stage.num_layers))


def pooled_costs(fits: Iterable[ComputeCosts]) -> ComputeCosts:
    """The median of each cost over ``fits`` (oldest first; the last ``FIT_WINDOW`` count), dated
    by the newest.

    Fits that disagree with the newest on whether the output layer is told apart (a layout with a
    different number of stages measured them) are left out.
    """
    fits = list(fits)[-FIT_WINDOW:]
    if not fits:
        raise ValueError("pooled_costs needs at least one fit")
    newest = fits[-1]
    alike = [f for f in fits if (f.output_forward_s is None) == (newest.output_forward_s is None)]
    output = None if newest.output_forward_s is None else statistics.median(f.output_forward_s for f in alike)
    return ComputeCosts(newest.iteration, statistics.median(f.layer_forward_s for f in alike), output,
                        statistics.median(f.backward_factor for f in alike))
