"""Checkpoint-restart with the Young/Daly checkpoint interval: the fallback every system shares.

Model of the classic policy analysed by J. W. Young, "A first order approximation to the optimum
checkpoint interval" (CACM 1974) and J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps" (FGCS 2006). Rule: write a checkpoint every
``tau = sqrt(2 * delta * M)`` seconds of work (Young), or Daly's refinement
``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta`` for ``delta < 2M``
and ``M`` otherwise, where ``delta`` is the time to write one checkpoint and ``M`` the mean time
between failures. A fail-stop costs the work done since the last checkpoint (``(tau + delta) / 2``
on average, failures arriving uniformly within an interval), plus the restart (``hw.restart_s``:
detection, relaunch, reload); the job then runs on the nodes without bad devices, same TP and
PP, as many replicas as fit. Checkpoints cost ``delta / (tau + delta)`` of wall time.

Simplified, and why:
- ``delta`` is each rank's share of the model and optimizer state over a per-rank storage
  bandwidth (``storage_Bps_per_rank``), written synchronously; asynchronous checkpointing would
  shrink it, and the same checkpoint cost is charged to every policy in a timeline, since in-place
  systems also keep checkpoints for the failures they cannot survive.
- A slow device is excluded by a restart only when the restart pays over the horizon (an
  operator who sees the slowdown); plain checkpoint-restart has no fail-slow detection.
- No spare nodes: the restart runs on what is left until repaired nodes come back.
"""

from __future__ import annotations

import dataclasses
import math

from resihp_ext.layout import Layout
from resihp_ext.peers.response import Response
from resihp_ext.planner.cost import equal_quotas, iteration_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.restart import GPUS_PER_NODE, excluded_nodes, restart_layout

NAME = "checkpoint-restart"
# bytes/s one rank writes to shared storage (an assumption: a few GB/s per node shared by 8 GPUs)
STORAGE_BPS_PER_RANK = 0.5e9


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum seconds of work between checkpoints, ``sqrt(2 * delta * M)``."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint_s and mtbf_s must be > 0, got {checkpoint_s}, {mtbf_s}")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum seconds of work between checkpoints.

    Args:
        checkpoint_s: seconds to write one checkpoint (delta).
        mtbf_s: mean seconds between failures of the job (M).

    Returns:
        The interval; ``M`` when ``delta >= 2M`` (checkpointing more often than failures is useless).
    """
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint_s and mtbf_s must be > 0, got {checkpoint_s}, {mtbf_s}")
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def expected_lost_s(interval_s: float, checkpoint_s: float) -> float:
    """Mean seconds of work lost by a failure arriving uniformly within one checkpoint period."""
    return (interval_s + checkpoint_s) / 2.0


def overhead_fraction(interval_s: float, checkpoint_s: float) -> float:
    """Share of wall time spent writing checkpoints."""
    return checkpoint_s / (interval_s + checkpoint_s)


def max_rank_state_bytes(layout: Layout, hw: HardwareModel) -> float:
    """Model and optimizer state bytes of the fullest rank (its stage's shard, embedding included)."""
    model, worst = layout.model, 0.0
    for rep in layout.replicas:
        for p, st in enumerate(rep.stages):
            params = st.num_layers * hw.layer_params(model)
            if p == 0:
                params += hw.embedding_params(model)
            if p == rep.num_stages - 1:
                params += model.vocab_size * model.hidden_size
            worst = max(worst, params * hw.state_bytes_per_param / st.tp_degree)
    return worst


def checkpoint_s(layout: Layout, hw: HardwareModel, storage_Bps_per_rank: float = STORAGE_BPS_PER_RANK) -> float:
    """Seconds to write one checkpoint: the fullest rank's state over its storage bandwidth.

    Every rank of one replica writes its own shard in parallel (Megatron's distributed checkpoint).
    """
    if storage_Bps_per_rank <= 0:
        raise ValueError(f"storage_Bps_per_rank must be > 0, got {storage_Bps_per_rank}")
    return max_rank_state_bytes(layout, hw) / storage_Bps_per_rank


def charge_lost_work(response: Response, lost_s: float) -> Response:
    """``response`` with ``lost_s`` seconds of lost work added to the restart it performs at once.

    A restart adopted later (Greyhound's S4) is planned: nothing is lost then.
    """
    if response.first.action != "checkpoint-restart":
        return response
    return dataclasses.replace(response, first=dataclasses.replace(
        response.first, one_time_cost_s=response.first.one_time_cost_s + lost_s))


def checkpoint_restart(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
                       num_microbatches: int | None = None, horizon_iters: int = 500,
                       lost_work_s: float = 0.0, gpus_per_node: int = GPUS_PER_NODE) -> Response:
    """Restart on the nodes without dead devices (and without slow ones when that pays).

    Args:
        layout: the layout running now.
        health: the failure.
        hw: cost constants (``hw.restart_s`` is the restart's cost).
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: iterations over which a restart for a slowdown must pay off.
        lost_work_s: seconds of work lost since the last checkpoint, charged to a restart.
        gpus_per_node: devices per node (a node with a bad device is excluded whole).

    Returns:
        A Response whose plan keeps the layout (nothing dead, restart does not pay) or restarts.
    """
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    quotas = equal_quotas(layout.num_replicas, num_mb)
    before_s = iteration_s(layout, quotas, health, hw)
    cost_s = hw.restart_s + lost_work_s

    def restart(bad: Health, why: str) -> Plan:
        new = restart_layout(layout, bad, gpus_per_node)
        if new is None:
            return Plan("checkpoint-restart", None, (), (), before_s, math.inf, cost_s,
                        f"{NAME}: too few healthy nodes for one replica", policy=NAME)
        q = equal_quotas(new.num_replicas, num_mb)
        # slowdowns on the nodes kept still apply after the restart
        after_s = iteration_s(new, q, health, hw)
        return Plan("checkpoint-restart", new, q, (), before_s, after_s, cost_s,
                    f"{NAME}: {why}; excluded node(s) {list(excluded_nodes(bad, gpus_per_node))}, "
                    f"restart with DP={new.num_replicas}", policy=NAME)

    dead_only = Health(dead=health.dead)
    if health.dead:
        plan = restart(dead_only, "a device failed stop")
    else:
        plan = Plan("keep", layout, quotas, (), before_s, before_s, 0.0, f"{NAME}: nothing failed stop", policy=NAME)
    if not health.affected_ranks - health.dead:
        return Response(NAME, plan)
    # a slowdown: restarting without its nodes is taken only when it pays over the horizon
    without_slow = restart(Health(speed=health.speed, dead=health.dead, slow_links=health.slow_links),
                           "devices failed stop or run slow")
    if horizon_iters * without_slow.iteration_s_after + without_slow.one_time_cost_s < \
            horizon_iters * plan.iteration_s_after + plan.one_time_cost_s:
        plan = without_slow
    return Response(NAME, plan)
