"""Iteration-time cost of a layout under a health state, for the planner's search.

Responsible for turning a replica's stages (layers, TP group) plus health into per-stage forward,
backward and transfer seconds, the affine fill + per-micro-batch model used inside the search,
the exact time of the replicas' schedule (1F1B, or the interleaved one) from
``resihp_ext.detection.simulator`` used for final scoring, and the gradient all-reduce time. It
decides nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from resihp_ext.interleaved_split import chunk_layers
from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec
from resihp_ext.planner.dp import assign_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.tp import group_time_factor
from resihp_ext.detection.simulator import pipeline_time_s
from resihp_ext.schedule import Interleaving


@dataclass(frozen=True)
class ReplicaTiming:
    """Per-stage seconds per micro-batch and per-boundary one-way transfer seconds of a replica.

    Transfers that block their sender (``HardwareModel.overlap_p2p`` False) are already counted in
    the sending op's seconds; ``p2p_s`` then holds zeros.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    p2p_s: tuple[float, ...]
    interleaving: Interleaving = Interleaving()
    # Under the interleaved schedule, each stage's share of its time per model chunk, where the
    # chunks differ in size (``chunk_shares``); None: equal shares.
    chunk_shares: tuple[tuple[float, ...], ...] | None = None

    @property
    def feasible(self) -> bool:
        return all(math.isfinite(v) for v in self.forward_s + self.backward_s + self.p2p_s)

    @property
    def per_microbatch_s(self) -> float:
        """Steady-state seconds per micro-batch: the slowest stage or the slowest link."""
        if not self.feasible:
            return math.inf
        stage = max(f + b for f, b in zip(self.forward_s, self.backward_s))
        return max([stage, *self.p2p_s])

    @property
    def fill_s(self) -> float:
        """Intercept of the affine model: one micro-batch's full trip minus one steady step (over
        the chunks per stage under the interleaved schedule, whose chunk ops fill the pipeline in
        that share of the time)."""
        if not self.feasible:
            return math.inf
        trip = sum(self.forward_s) + sum(self.backward_s) + 2 * sum(self.p2p_s)
        return (trip - self.per_microbatch_s) / self.interleaving.num_chunks

    def estimate_s(self, num_microbatches: int) -> float:
        """Affine estimate ``fill + m * per_microbatch`` (0 when idle)."""
        if num_microbatches == 0:
            return 0.0
        return self.fill_s + num_microbatches * self.per_microbatch_s

    def simulate_s(self, num_microbatches: int) -> float:
        """Exact time of the replica's schedule from the schedule simulator."""
        if num_microbatches == 0:
            return 0.0
        if not self.feasible:
            return math.inf
        return pipeline_time_s(len(self.forward_s), num_microbatches, self.forward_s, self.backward_s,
                               self.p2p_s, self.interleaving.num_chunks, self.interleaving.group_size,
                               self.chunk_shares)


def quota_step(hw: HardwareModel, num_stages: int) -> int:
    """The micro-batches a replica's quota is a multiple of: 1 under 1F1B; under the interleaved
    schedule its group size (the pipeline's by default). Multiples of a group are counts the
    schedule runs (``resihp_ext.schedule.interleaved_runs``); with megatron-core's default group they are
    all of them."""
    if hw.interleaving.num_chunks == 1 or num_stages == 1:
        return 1
    return hw.interleaving.group_size or num_stages


def layer_costs(model: ModelSpec, hw: HardwareModel) -> tuple[float, ...]:
    """Forward seconds of each layer at TP=1, speed 1 (layers are identical in a GPT)."""
    return (hw.layer_forward_tp1_s(model),) * model.num_layers


def timing_from_factors(
    layers_per_stage: Sequence[int],
    s_per_tp1_s: Sequence[float],
    transfers_s: Sequence[tuple[float, float]],
    model: ModelSpec,
    hw: HardwareModel,
) -> ReplicaTiming:
    """Replica timing from layer counts, each stage's seconds per TP=1 second of work, and each
    boundary's (activation, gradient) transfer seconds."""
    layer_s = hw.layer_forward_tp1_s(model)
    last = len(layers_per_stage) - 1
    fwd = [
        factor * (n * layer_s + (hw.output_forward_tp1_s(model) if p == last else 0.0))
        for p, (n, factor) in enumerate(zip(layers_per_stage, s_per_tp1_s))
    ]
    bwd = [hw.backward_factor * f for f in fwd]
    schedule = hw.interleaving
    shares = chunk_shares(layers_per_stage, model, hw)
    if hw.overlap_p2p:
        return ReplicaTiming(tuple(fwd), tuple(bwd), tuple(max(pair) for pair in transfers_s), schedule, shares)
    # The sender waits for its transfer before its next op: activations after a forward,
    # gradients after a backward. The receiver's wait is already the DAG edge from that op. Under
    # the interleaved schedule every chunk's op sends, and the last stage sends each micro-batch
    # on to the first stage's next chunk (a transfer priced as the mean boundary's).
    chunks = schedule.num_chunks
    for s, (activation_s, gradient_s) in enumerate(transfers_s):
        fwd[s] += chunks * activation_s
        bwd[s + 1] += chunks * gradient_s
    if chunks > 1 and transfers_s:
        fwd[-1] += (chunks - 1) * sum(a for a, _ in transfers_s) / len(transfers_s)
        bwd[0] += (chunks - 1) * sum(g for _, g in transfers_s) / len(transfers_s)
    return ReplicaTiming(tuple(fwd), tuple(bwd), (0.0,) * len(transfers_s), schedule, shares)


def chunk_shares(layers_per_stage: Sequence[int], model: ModelSpec,
                 hw: HardwareModel) -> tuple[tuple[float, ...], ...] | None:
    """Under the interleaved schedule, each stage's share of its compute per model chunk for this
    split (``resihp_ext.interleaved_split``: the chunks a move leaves are of unequal size; the last
    stage's last chunk also runs the output layer), or None where every chunk of a stage is alike.
    A stage's transfers, charged to its ops when they block (``overlap_p2p`` False), are spread
    over its chunks by the same shares."""
    launch = model.launch_chunks
    if hw.interleaving.num_chunks == 1 or launch is None or len(launch) != len(layers_per_stage) \
            or len(launch[0]) != hw.interleaving.num_chunks:
        return None
    chunks = chunk_layers(launch, tuple(layers_per_stage))
    layer_s, output_s = hw.layer_forward_tp1_s(model), hw.output_forward_tp1_s(model)
    last = len(chunks) - 1
    work = [[n * layer_s + (output_s if p == last and v == len(stage) - 1 else 0.0) for v, n in enumerate(stage)]
            for p, stage in enumerate(chunks)]
    shares = tuple(tuple(w / sum(row) for w in row) for row in work)
    return None if all(len(set(row)) == 1 for row in shares) else shares


def boundary_transfers_s(replica: ReplicaSpec, model: ModelSpec, hw: HardwareModel,
                         health: Health) -> tuple[tuple[float, float], ...]:
    """Per boundary, one micro-batch's (activation, gradient) transfer seconds. Activations go from
    stage s to s + 1 and gradients back; each direction is as slow as its slowest pair of ranks."""
    out = []
    for a, b in zip(replica.stages, replica.stages[1:]):
        forward = backward = 1.0
        for (x, y), v in health.slow_links.items():
            if x in a.ranks and y in b.ranks:
                forward = min(forward, v)
            elif y in a.ranks and x in b.ranks:
                backward = min(backward, v)
        out.append((hw.p2p_s(model, forward), hw.p2p_s(model, backward)))
    return tuple(out)


def replica_timing(replica: ReplicaSpec, model: ModelSpec, hw: HardwareModel, health: Health) -> ReplicaTiming:
    """Timing of an existing replica under ``health`` (inf stages if a member is dead)."""
    factors = [group_time_factor(st.ranks, health, hw) for st in replica.stages]
    return timing_from_factors(replica.layers_per_stage, factors, boundary_transfers_s(replica, model, hw, health),
                               model, hw)


def max_params_per_rank(replica: ReplicaSpec, model: ModelSpec, hw: HardwareModel) -> float:
    """Largest transformer-parameter count any rank of ``replica`` holds (its gradient volume)."""
    return max(st.num_layers * hw.layer_params(model) / st.tp_degree for st in replica.stages)


def allreduce_time_s(num_replicas: int, params_per_rank: float, hw: HardwareModel, link_speed: float = 1.0) -> float:
    """Ring all-reduce seconds of ``params_per_rank`` gradients over ``num_replicas`` replicas."""
    if num_replicas <= 1 or hw.grad_bytes_per_param == 0:
        return 0.0
    volume = 2.0 * (num_replicas - 1) / num_replicas * params_per_rank * hw.grad_bytes_per_param
    return volume / (hw.link_bandwidth_Bps * link_speed)


def allreduce_s(layout: Layout, hw: HardwareModel, health: Health) -> float:
    """All-reduce of the largest per-rank gradient, slowed by the slowest cross-replica link."""
    if layout.num_replicas == 1:
        return 0.0
    params = max(max_params_per_rank(rep, layout.model, hw) for rep in layout.replicas)
    link = 1.0
    for (a, b), v in health.slow_links.items():
        if layout.contains(a) and layout.contains(b) and layout.replica_of(a) != layout.replica_of(b):
            link = min(link, v)
    return allreduce_time_s(layout.num_replicas, params, hw, link)


def iteration_s(layout: Layout, quotas: Sequence[int], health: Health, hw: HardwareModel) -> float:
    """Exact predicted iteration seconds: slowest replica's 1F1B time plus the gradient all-reduce.

    A replica with a dead member and a non-zero quota stalls the job (inf).
    """
    if len(quotas) != layout.num_replicas:
        raise ValueError(f"{len(quotas)} quotas for {layout.num_replicas} replicas; give one per replica")
    slowest = max(replica_timing(rep, layout.model, hw, health).simulate_s(q)
                  for rep, q in zip(layout.replicas, quotas))
    return slowest + allreduce_s(layout, hw, health)


def speed_quotas(layout: Layout, health: Health, hw: HardwareModel,
                 num_microbatches: int) -> tuple[tuple[int, ...], float]:
    """Quotas split by replica speed (``dp.assign_quotas``) and the exact iteration seconds under them."""
    timings = [replica_timing(rep, layout.model, hw, health) for rep in layout.replicas]
    step = max(quota_step(hw, rep.num_stages) for rep in layout.replicas)
    quotas = assign_quotas([t.fill_s for t in timings], [t.per_microbatch_s for t in timings], num_microbatches,
                           step=step)
    return quotas, iteration_s(layout, quotas, health, hw)


def capacity_bound_s(layout: Layout, health: Health, hw: HardwareModel, num_microbatches: int) -> float:
    """Least iteration seconds the surviving hardware could reach.

    The healthy run's iteration time scaled by total healthy speed over total surviving speed:
    perfect balancing, and no pipeline bubble beyond the healthy run's.
    """
    base = Health()
    quotas = equal_quotas(layout.num_replicas, num_microbatches)
    healthy_s = iteration_s(layout, quotas, base, hw)
    ranks = layout.world_ranks
    surviving = sum(health.speed_of(r) for r in ranks)
    return healthy_s * len(ranks) / surviving if surviving > 0 else math.inf


def equal_quotas(num_replicas: int, num_microbatches: int) -> tuple[int, ...]:
    """Megatron's split: every replica runs the same count (the first few one more if uneven)."""
    base, extra = divmod(num_microbatches, num_replicas)
    return tuple(base + (1 if r < extra else 0) for r in range(num_replicas))
