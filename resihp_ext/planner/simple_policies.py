"""Comparison policies with the ResiHP planner's interface, written from their published ideas.

Responsible for the baselines every throughput claim is measured against:

* ``no_adaptation``: change nothing (a dead rank stalls the job);
* ``dp_only``: move micro-batches between DP replicas by their speed, layout untouched; a
  replica with a dead rank stops taking micro-batches (the idea of Greyhound / ReCycle: only the
  data-parallel dimension adapts);
* ``drop_replica``: remove every replica holding a bad (dead or slow) device and split the
  batch over the rest (the pipeline-level reconfiguration of Oobleck at replica granularity);
* ``checkpoint_restart``: stop, exclude the nodes holding bad devices, restart from a checkpoint
  on the largest uniform layout the remaining nodes allow, paying ``hw.restart_s``.

All return a ``Plan``; none of them moves state in place.
"""

from __future__ import annotations

import math
from typing import Callable

from resihp_ext.layout import Layout
from resihp_ext.planner.cost import equal_quotas, iteration_s, speed_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.restart import GPUS_PER_NODE, excluded_nodes, restart_layout


def _setup(layout, health, hw, num_microbatches, current_quotas):
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    quotas = current_quotas or equal_quotas(layout.num_replicas, num_mb)
    return hw, num_mb, quotas, iteration_s(layout, quotas, health, hw)


def _restart_plan(policy: str, layout: Layout, before_s: float, hw: HardwareModel, reason: str) -> Plan:
    return Plan("checkpoint-restart", None, (), (), before_s, math.inf, hw.restart_s, reason, policy=policy)


def _rebalanced(policy: str, layout: Layout, keep: list[int], health: Health, hw: HardwareModel,
                num_mb: int, before_s: float) -> Plan:
    """Plan that keeps the replicas ``keep`` as they are and re-splits the batch by their speed."""
    if not keep:
        return _restart_plan(policy, layout, before_s, hw, f"{policy}: no replica is left to train on")
    new = layout if len(keep) == layout.num_replicas else layout.with_replicas(layout.replicas[i] for i in keep)
    quotas, after_s = speed_quotas(new, health, hw, num_mb)
    dropped = layout.num_replicas - len(keep)
    cost_s = hw.regroup_s if dropped else 0.0
    used = set(new.world_ranks)
    spares = tuple(r for r in layout.world_ranks if r not in used and r not in health.dead)
    return Plan("adapt", new, quotas, (), before_s, after_s, cost_s,
                f"{policy}: dropped {dropped} replica(s), quotas {list(quotas)}", spares, policy=policy)


def no_adaptation(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
                  num_microbatches: int | None = None, horizon_iters: int = 500,
                  current_quotas: tuple[int, ...] | None = None) -> Plan:
    """Keep layout and quotas whatever happens."""
    hw, _, quotas, before_s = _setup(layout, health, hw, num_microbatches, current_quotas)
    return Plan("keep", layout, quotas, (), before_s, before_s, 0.0, "no-adaptation: nothing changes",
                policy="no-adaptation")


def dp_only(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
            num_microbatches: int | None = None, horizon_iters: int = 500,
            current_quotas: tuple[int, ...] | None = None) -> Plan:
    """Micro-batch migration between replicas only; replicas with a dead rank leave."""
    hw, num_mb, _, before_s = _setup(layout, health, hw, num_microbatches, current_quotas)
    bad = set(layout.replicas_touching(health.dead))
    keep = [i for i in range(layout.num_replicas) if i not in bad]
    return _rebalanced("dp-only", layout, keep, health, hw, num_mb, before_s)


def drop_replica(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
                 num_microbatches: int | None = None, horizon_iters: int = 500,
                 current_quotas: tuple[int, ...] | None = None) -> Plan:
    """Remove every replica that holds a dead or slow device (or an end of a slow link)."""
    hw, num_mb, _, before_s = _setup(layout, health, hw, num_microbatches, current_quotas)
    bad = set(layout.replicas_touching(health.affected_ranks))
    keep = [i for i in range(layout.num_replicas) if i not in bad]
    return _rebalanced("drop-replica", layout, keep, health, hw, num_mb, before_s)


def checkpoint_restart(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
                       num_microbatches: int | None = None, horizon_iters: int = 500,
                       current_quotas: tuple[int, ...] | None = None,
                       gpus_per_node: int = GPUS_PER_NODE) -> Plan:
    """Restart on the nodes without bad devices, same TP/PP, as many replicas as fit."""
    hw, num_mb, _, before_s = _setup(layout, health, hw, num_microbatches, current_quotas)
    new = restart_layout(layout, health, gpus_per_node)
    if new is None:
        return _restart_plan("checkpoint-restart", layout, before_s, hw,
                             "checkpoint-restart: too few healthy nodes for one replica")
    dp_degree = new.num_replicas
    quotas = equal_quotas(dp_degree, num_mb)
    after_s = iteration_s(new, quotas, Health(), hw)
    return Plan("checkpoint-restart", new, quotas, (), before_s, after_s, hw.restart_s,
                f"checkpoint-restart: excluded node(s) {list(excluded_nodes(health, gpus_per_node))}, "
                f"restart with DP={dp_degree}",
                policy="checkpoint-restart")


Policy = Callable[..., Plan]
POLICIES: dict[str, Policy] = {
    "resihp": plan_adaptation,
    "no-adaptation": no_adaptation,
    "dp-only": dp_only,
    "drop-replica": drop_replica,
    "checkpoint-restart": checkpoint_restart,
}
BASELINES = tuple(name for name in POLICIES if name != "resihp")
