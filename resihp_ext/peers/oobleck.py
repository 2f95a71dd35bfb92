"""Oobleck: heterogeneous pipelines re-instantiated from precomputed templates after a fail-stop.

Model of I. Jang, Z. Yang, Z. Zhang, X. Jin, M. Chowdhury, "Oobleck: Resilient Distributed
Training of Large Models Using Pipeline Templates" (SOSP 2023). Rule: before training, compute a
pipeline template (stage count and layer split) for every pipeline size from the fewest nodes
that hold the model up to about twice the running size; on a node failure, re-instantiate
pipelines from these templates so that every surviving node is used, choosing the combination
with the highest predicted throughput, and split the global batch over the pipelines in
proportion to their template throughput (the global batch is kept). No fail-slow handling: the
templates assume healthy nodes, so slow devices stay and their pipelines get a healthy share.

Everything is scored with the project's cost model: a template of ``k`` nodes has ``k * gpus /
TP`` stages at the running TP degree, its layers split by ``planner.pp.partition_layers`` under
the memory caps; the chosen instantiation's iteration time is ``planner.cost.iteration_s`` under
the real health.

Simplified, and why:
- The unit of failure is a node (Oobleck's), so a node with one dead GPU leaves whole.
- Instantiations are limited to pipelines of as-even-as-possible sizes (``x`` pipelines over
  ``N`` nodes, sizes ``N // x`` and ``N // x + 1``) instead of Oobleck's full search over size
  mixes; even sizes are what that search picks when nodes are alike. Counts are ranked by the
  continuous batch split and the best ``NUM_EXACT`` split exactly, so 4,096 GPUs take ~0.1 s.
- Re-instantiation cost: one regroup plus the state a rank must receive, its new stage's shard in
  full when its layers or TP group changed (no credit for state it happens to hold already).
"""

from __future__ import annotations

from functools import lru_cache

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response, fail_slow_unhandled, start
from resihp_ext.planner.cost import allreduce_time_s, iteration_s, layer_costs, timing_from_factors
from resihp_ext.planner.dp import assign_quotas, makespan_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import max_layers_on_stage
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.pp import partition_layers
from resihp_ext.planner.restart import GPUS_PER_NODE
from resihp_ext.planner.tp import group_time_factor

NAME = "oobleck"
NUM_EXACT = 4  # pipeline counts whose batch split is computed exactly


def template(num_nodes: int, tp_degree: int, model, hw: HardwareModel, num_microbatches: int,
             gpus_per_node: int = GPUS_PER_NODE):
    """Layers per stage of the pipeline template for ``num_nodes`` nodes, or None if none fits."""
    return _template(num_nodes, tp_degree, model, hw, num_microbatches, gpus_per_node)


@lru_cache(maxsize=1024)
def _template(num_nodes, tp_degree, model, hw, num_microbatches, gpus_per_node):
    num_stages = num_nodes * gpus_per_node // tp_degree
    if num_stages < 1 or num_stages > model.num_layers:
        return None
    factor = group_time_factor(tuple(range(tp_degree)), Health(), hw)
    caps = [max_layers_on_stage(model, hw, tp_degree=tp_degree, stage=p, num_stages=num_stages,
                                num_microbatches=num_microbatches) for p in range(num_stages)]
    part = partition_layers(layer_costs(model, hw), [factor] * num_stages,
                            last_extra=hw.output_forward_tp1_s(model), max_layers=caps)
    if part is None:
        return None
    transfers = ((hw.p2p_s(model), hw.p2p_s(model)),) * (num_stages - 1)
    timing = timing_from_factors(part.layers_per_stage, [factor] * num_stages, transfers, model, hw)
    return part.layers_per_stage, timing


def _replica(ranks: list[int], split: tuple[int, ...], tp_degree: int) -> ReplicaSpec:
    stages, first = [], 0
    for p, num in enumerate(split):
        stages.append(StageSpec(first, num, tuple(ranks[p * tp_degree:(p + 1) * tp_degree])))
        first += num
    return ReplicaSpec(tuple(stages))


def _move_s(old: Layout, new: Layout, hw: HardwareModel) -> float:
    model, worst = old.model, 0.0
    for rep in new.replicas:
        for st in rep.stages:
            params = st.num_layers * hw.layer_params(model)
            for rank in st.ranks:
                was = old.stage_spec_of(rank)
                if (was.first_layer, was.num_layers, was.tp_degree) != (st.first_layer, st.num_layers, st.tp_degree):
                    worst = max(worst, params * hw.state_bytes_per_param / st.tp_degree)
    return worst / hw.link_bandwidth_Bps


def oobleck(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
            num_microbatches: int | None = None, horizon_iters: int = 500,
            current_quotas: tuple[int, ...] | None = None, gpus_per_node: int = GPUS_PER_NODE) -> Response:
    """Oobleck's response to ``health``.

    Args:
        layout: the layout running now (one TP degree; each pipeline a whole number of nodes).
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: unused (Oobleck re-instantiates on every failure); kept for the shared signature.
        current_quotas: micro-batches per pipeline now (default: equal).
        gpus_per_node: devices per node.

    Returns:
        A Response: keep (nothing dead), re-instantiate, or checkpoint-restart (no template fits).
    """
    at = start(layout, health, hw, num_microbatches, current_quotas)
    if not health.dead:
        return fail_slow_unhandled(NAME, layout, at)
    hw, num_mb, before_s = at.hw, at.num_microbatches, at.before_s
    model = layout.model
    tp_degree = layout.replicas[0].stages[0].tp_degree
    ranks_per_pipeline = len(layout.replicas[0].ranks)
    if ranks_per_pipeline % gpus_per_node:
        raise ValueError(f"Oobleck's pipelines span whole nodes; {ranks_per_pipeline} ranks per pipeline "
                         f"is not a multiple of {gpus_per_node} GPUs per node")
    running_nodes = ranks_per_pipeline // gpus_per_node
    bad = {r // gpus_per_node for r in health.dead}
    nodes = sorted({r // gpus_per_node for r in layout.world_ranks} - bad)
    sizes = [k for k in range(1, 2 * running_nodes + 1)
             if template(k, tp_degree, model, hw, num_mb, gpus_per_node) is not None]
    # rank every pipeline count by the continuous split (each pipeline finishing at the same T:
    # sum_i (T - fill_i) / per_i = M), then split the best few exactly
    shapes = []
    for count in range(1, len(nodes) // min(sizes, default=len(nodes) + 1) + 1):
        base, extra = divmod(len(nodes), count)
        shape = [base + 1] * extra + [base] * (count - extra)
        if count > num_mb or any(k not in sizes for k in shape):
            continue
        kinds = [(n, template(k, tp_degree, model, hw, num_mb, gpus_per_node)[1])
                 for n, k in ((extra, base + 1), (count - extra, base)) if n]
        rate = sum(n / t.per_microbatch_s for n, t in kinds)
        relaxed_s = (num_mb + sum(n * t.fill_s / t.per_microbatch_s for n, t in kinds)) / rate
        params = hw.layer_params(model) * max(max(template(k, tp_degree, model, hw, num_mb, gpus_per_node)[0])
                                              for k in set(shape)) / tp_degree
        shapes.append((relaxed_s + allreduce_time_s(count, params, hw), shape, params))
    best = None
    for _, shape, params in sorted(shapes)[:NUM_EXACT]:
        timings = [template(k, tp_degree, model, hw, num_mb, gpus_per_node)[1] for k in shape]
        q = assign_quotas([t.fill_s for t in timings], [t.per_microbatch_s for t in timings], num_mb)
        est_s = makespan_s([t.fill_s for t in timings], [t.per_microbatch_s for t in timings], q) + \
            allreduce_time_s(len(shape), params, hw)
        if best is None or est_s < best[0]:
            best = (est_s, shape, q)
    if best is None:
        return checkpoint_restart(layout, health, hw, num_microbatches=num_mb, horizon_iters=horizon_iters,
                                  gpus_per_node=gpus_per_node)
    _, shape, q = best
    replicas, at = [], 0
    for k in shape:
        ranks = [n * gpus_per_node + g for n in nodes[at:at + k] for g in range(gpus_per_node)]
        replicas.append(_replica(ranks, template(k, tp_degree, model, hw, num_mb, gpus_per_node)[0], tp_degree))
        at += k
    new = layout.with_replicas(replicas)
    after_s = iteration_s(new, q, health, hw)
    cost_s = hw.regroup_s + _move_s(layout, new, hw)
    return Response(NAME, Plan(
        "adapt", new, q, (), before_s, after_s, cost_s,
        f"{NAME}: node(s) {sorted(bad)} lost; {len(shape)} pipelines of {sorted(set(shape))} nodes from templates, "
        f"quotas by template throughput; {after_s:.3f} s/iter", policy=NAME))
