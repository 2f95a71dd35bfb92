"""NTP: a replica whose TP group lost a GPU keeps training at a lower, nonuniform TP degree.

Model of nonuniform tensor parallelism as described in "Nonuniform-Tensor-Parallelism:
Mitigating GPU failure impact for Scaled-up LLM Training" (Arfeen et al., 2025). Rule: when a
GPU of a TP group fails, the group re-shards its layers over its ``k' = k - failed`` surviving GPUs
(``k'`` need not be a power of two, nor divide the head count: some GPUs take one more head), and
the data-parallel gradient sync maps the ``k'`` shards onto the healthy replicas' ``k``. Its
pipeline runs as fast as its slowest, re-sharded stage, so the global batch is split by replica
speed (the degraded replica takes fewer micro-batches). No fail-slow handling.

A nonuniform TP degree is not a valid Layout (ours keeps powers of two), so the degraded replica's
per-stage seconds are built directly with the cost model's pieces: the compute share of a stage
at ``k'`` GPUs is the busiest GPU's, ``ceil(heads / k') / heads``, at the slowest member's speed,
plus the same TP communication share the cost model charges a group of ``k'``.

Simplified, and why:
- A group that cannot hold its layers at ``k'`` GPUs (memory model of ``planner.memory``), or
  that lost every GPU, drops its replica (NTP needs one survivor per group).
- Re-sharding cost: a regroup plus each survivor receiving its extra share of the stage's state,
  ``(1/k' - 1/k)`` of it, over one link.
- The plan's ``layout`` is the running one; its quotas give the degraded replicas' share.
"""

from __future__ import annotations

import math

from resihp_ext.layout import Layout, StageSpec
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response, fail_slow_unhandled, start
from resihp_ext.planner.cost import allreduce_time_s, boundary_transfers_s, replica_timing, timing_from_factors
from resihp_ext.planner.dp import assign_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import stage_memory_bytes
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.tp import group_time_factor

NAME = "ntp"


def nonuniform_time_factor(ranks: list[int], num_heads: int, health: Health, hw: HardwareModel) -> float:
    """Seconds per TP=1, speed-1 second of work of a TP group of ``len(ranks)`` GPUs, any count.

    Equals ``planner.tp.group_time_factor`` when the count divides ``num_heads``.
    """
    k = len(ranks)
    speed = min(health.speed_of(r) for r in ranks)
    if k == 0 or speed <= 0.0:
        return math.inf
    share = hw.comm_share(k) if k > 1 else 0.0
    compute = math.ceil(num_heads / k) / num_heads / speed
    if share == 0.0:
        return compute
    link = min((v for (a, b), v in health.slow_links.items() if a in ranks and b in ranks), default=1.0)
    return compute + share / (k * (1.0 - share) * link)


def _fits(stage: StageSpec, p: int, num_stages: int, k: int, layout: Layout, hw: HardwareModel, num_mb: int) -> bool:
    used = stage_memory_bytes(layout.model, hw, num_layers=stage.num_layers, tp_degree=k, stage=p,
                              num_stages=num_stages, num_microbatches=num_mb)
    return used <= hw.device_memory_bytes


def ntp(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
        num_microbatches: int | None = None, horizon_iters: int = 500,
        current_quotas: tuple[int, ...] | None = None) -> Response:
    """NTP's response to ``health``.

    Args:
        layout: the layout running now.
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: unused; kept for the shared signature.
        current_quotas: micro-batches per replica now (default: equal).

    Returns:
        A Response: keep (nothing dead), continue at lower TP, or checkpoint-restart.
    """
    at = start(layout, health, hw, num_microbatches, current_quotas)
    if not health.dead:
        return fail_slow_unhandled(NAME, layout, at)
    hw, num_mb, before_s = at.hw, at.num_microbatches, at.before_s
    model = layout.model
    timings, params, move_bytes, notes = [], [], 0.0, []
    for r, rep in enumerate(layout.replicas):
        factors, worst, ok = [], 0.0, True
        for p, st in enumerate(rep.stages):
            alive = [x for x in st.ranks if x not in health.dead]
            if len(alive) == st.tp_degree:
                factors.append(group_time_factor(st.ranks, health, hw))
                worst = max(worst, st.num_layers * hw.layer_params(model) / st.tp_degree)
                continue
            if not alive or not _fits(st, p, rep.num_stages, len(alive), layout, hw, num_mb):
                ok = False
                break
            factors.append(nonuniform_time_factor(alive, model.num_attention_heads, health, hw))
            worst = max(worst, st.num_layers * hw.layer_params(model) / len(alive))
            extra = st.num_layers * hw.layer_params(model) * hw.state_bytes_per_param * (
                1.0 / len(alive) - 1.0 / st.tp_degree)
            move_bytes = max(move_bytes, extra)
            notes.append(f"replica {r} stage {p} TP {st.tp_degree}->{len(alive)}")
        if not ok:
            timings.append(None)
            notes.append(f"replica {r} dropped")
            continue
        if factors == [group_time_factor(st.ranks, health, hw) for st in rep.stages]:
            timings.append(replica_timing(rep, model, hw, health))
        else:
            timings.append(timing_from_factors(rep.layers_per_stage, factors,
                                               boundary_transfers_s(rep, model, hw, health), model, hw))
        params.append(worst)
    kept = [t for t in timings if t is not None]
    if not kept or len(kept) > num_mb:
        return checkpoint_restart(layout, health, hw, num_microbatches=num_mb, horizon_iters=horizon_iters)
    inf = math.inf
    q = assign_quotas([t.fill_s if t else 0.0 for t in timings], [t.per_microbatch_s if t else inf for t in timings],
                      num_mb)
    after_s = max(t.simulate_s(n) for t, n in zip(timings, q) if t is not None) + \
        allreduce_time_s(len(kept), max(params), hw)
    cost_s = hw.regroup_s + move_bytes / hw.link_bandwidth_Bps
    return Response(NAME, Plan("adapt", layout, q, (), before_s, after_s, cost_s,
                               f"{NAME}: {'; '.join(notes)}; quotas by speed; {after_s:.3f} s/iter", policy=NAME))
