"""Our policies in the evaluation's shape: the planner's plan, and what the executor runs on a fail-stop.

Responsible for wrapping ``planner.joint.plan_adaptation`` (the ResiHP decision, which the
comparison calls "resihp") and, as "resihp-in-place", the plan the live executor carries out after a
fail-stop today: ``planner.survivors.plan_survivors`` (whole replicas kept, replicas rebuilt from
intact or shrunken stage groups, batch split by speed), with ``plan_adaptation`` for slowdowns
alone. The second is reported beside the first so that the gap between what the planner proposes
and what the executor can run is visible. Nothing here searches.
"""

from __future__ import annotations

from resihp_ext.layout import Layout
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response, from_plan
from resihp_ext.planner.cost import equal_quotas, iteration_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.moves import move_time_s
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.survivors import continuing_layout, plan_survivors

OURS = "resihp"
IN_PLACE = "resihp-in-place"


def resihp(layout: Layout, health: Health, hw: HardwareModel | None = None, *, num_microbatches: int | None = None,
           horizon_iters: int = 500) -> Response:
    """Our policy, ``planner.joint.plan_adaptation``, as a Response."""
    return from_plan(plan_adaptation(layout, health, hw, num_microbatches=num_microbatches,
                                     horizon_iters=horizon_iters), OURS)


def resihp_in_place(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
                    num_microbatches: int | None = None, horizon_iters: int = 500) -> Response:
    """What the executor runs: survivor plans after a fail-stop, ``plan_adaptation`` otherwise.

    Args:
        layout: the layout running now.
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: iterations over which a fail-slow adaptation must pay off.

    Returns:
        A Response.
    """
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    if not health.dead:
        return from_plan(plan_adaptation(layout, health, hw, num_microbatches=num_mb,
                                         horizon_iters=horizon_iters), IN_PLACE)
    alive = Health(speed={r: v for r, v in health.speed.items() if r not in health.dead},
                   slow_links=health.slow_links)
    plan = plan_survivors(layout, health.dead, hw=hw, health=alive)
    if plan.action != "adapt":
        answer = checkpoint_restart(layout, health, hw, num_microbatches=num_mb, horizon_iters=horizon_iters)
        return Response(IN_PLACE, answer.first)
    new = continuing_layout(layout, plan)
    quotas = plan.quotas or equal_quotas(new.num_replicas, num_mb)
    before_s = iteration_s(layout, equal_quotas(layout.num_replicas, num_mb), health, hw)
    after_s = iteration_s(new, quotas, health, hw)
    moves = plan.transfers  # exactly what the executor runs: shard_map's transfers, priced
    return Response(IN_PLACE, Plan("adapt", new, tuple(quotas), moves, before_s, after_s,
                                   hw.regroup_s + move_time_s(moves, hw), plan.reason, policy=IN_PLACE))
