"""Greyhound: fail-slow mitigation by micro-batch redistribution, then topology adjustment.

Model of the multi-level mitigation of "Greyhound: Hunting Fail-Slows in Hybrid-Parallel
Training at Scale" (USENIX ATC 2025; the journal of its preprint is Falcon, Wu et al. 2024).
Rule: on a fail-slow, apply S1 at once, redistributing micro-batches across data-parallel
replicas by their measured speed (free: only the data split changes). S2 adjusts the parallel
topology: slow devices swap places with healthy ones so that they gather in as few pipelines
(and, inside them, as few TP groups) as possible, those pipelines' layers are repartitioned by
stage speed, and S1's redistribution runs on top. S2 costs a regroup plus the state the swapped
and repartitioned ranks receive, so it is chosen by the ski-rental rule: keep "renting" S1 until
the time S1 has lost against S2 equals S2's one-time cost, then "buy" S2 (deterministic
ski-rental, never worse than twice the offline optimum, without knowing how long the slowdown
lasts).

Simplified, and why:
- Greyhound mitigates fail-slow only. A fail-stop is handed to checkpoint-restart
  (``peers.checkpoint_restart``); slowdowns on the restarted nodes then get S1 and S2 as usual.
- Slow links are handled by S1 only (swapping devices does not move a link).
- The slowdown is known exactly when it starts (detection delay is not charged to anyone).
"""

from __future__ import annotations

import dataclasses
import math

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response
from resihp_ext.planner.cost import equal_quotas, iteration_s, layer_costs, speed_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.moves import move_time_s, state_moves
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.pp import partition_layers
from resihp_ext.planner.tp import group_time_factor

NAME = "greyhound"


def gather_slow(layout: Layout, health: Health) -> tuple[Layout, tuple[int, ...]]:
    """The layout with slow devices swapped into the fewest pipelines, and the pipelines changed.

    Sink pipelines are those already holding the most slow devices; their slots are filled in
    stage and TP order, slowest device first, each slow device swapping with the healthy device
    holding the slot.
    """
    slow = sorted((r for r, v in health.speed.items() if v < 1.0 and layout.contains(r) and r not in health.dead),
                  key=lambda r: (health.speed[r], r))
    if not slow:
        return layout, ()
    per_replica = len(layout.replicas[0].ranks)
    counts = {i: sum(1 for r in slow if layout.replica_of(r) == i) for i in range(layout.num_replicas)}
    sinks = sorted(counts, key=lambda i: (-counts[i], i))[:math.ceil(len(slow) / per_replica)]
    slots = [r for i in sorted(sinks) for r in layout.replicas[i].ranks]
    position = {r: r for r in layout.world_ranks}  # slot -> device now in it
    where = dict(position)                          # device -> its slot
    for slot, device in zip(slots, slow):
        other = position[slot]
        if other == device:
            continue
        old_slot = where[device]
        position[slot], position[old_slot] = device, other
        where[device], where[other] = slot, old_slot
    rename = {slot: device for slot, device in position.items() if slot != device}
    if not rename:
        return layout, ()
    changed = layout.replicas_touching(rename)
    return layout.relabel({r: rename.get(r, r) for r in layout.world_ranks}), changed


def _repartitioned(rep: ReplicaSpec, layout: Layout, health: Health, hw: HardwareModel) -> ReplicaSpec:
    factors = [group_time_factor(st.ranks, health, hw) for st in rep.stages]
    part = partition_layers(layer_costs(layout.model, hw), factors, last_extra=hw.output_forward_tp1_s(layout.model),
                            prefer=rep.layers_per_stage)
    if part is None:
        return rep
    stages, first = [], 0
    for num, st in zip(part.layers_per_stage, rep.stages):
        stages.append(StageSpec(first, num, st.ranks))
        first += num
    return ReplicaSpec(tuple(stages))


def greyhound(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
              num_microbatches: int | None = None, horizon_iters: int = 500,
              current_quotas: tuple[int, ...] | None = None) -> Response:
    """Greyhound's response to ``health``: S1 now, S2 when the ski-rental rule says so.

    Args:
        layout: the layout running now.
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: unused (ski-rental needs no horizon); kept for the shared signature.
        current_quotas: micro-batches per replica now (default: equal).

    Returns:
        A Response whose ``first`` is S1 (or a restart) and whose ``then`` is S2 when S2 is faster.
    """
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    if health.dead:
        restart = checkpoint_restart(layout, Health(dead=health.dead), hw, num_microbatches=num_mb).first
        if restart.layout is None or not health.affected_ranks - health.dead:
            return Response(NAME, dataclasses.replace(restart, policy=NAME))
        base, cost_s = restart.layout, restart.one_time_cost_s
        before_s = restart.iteration_s_before
    else:
        base, cost_s = layout, 0.0
        before_s = iteration_s(layout, current_quotas or equal_quotas(layout.num_replicas, num_mb), health, hw)
    quotas, s1_s = speed_quotas(base, health, hw, num_mb)
    s1 = Plan("checkpoint-restart" if health.dead else "adapt", base, quotas, (), before_s, s1_s, cost_s,
              f"{NAME} S1: micro-batches by replica speed {list(quotas)}; {s1_s:.3f} s/iter", policy=NAME)
    swapped, changed = gather_slow(base, health)
    new = swapped.with_replicas(_repartitioned(rep, swapped, health, hw) if i in changed else rep
                                for i, rep in enumerate(swapped.replicas))
    if not changed:
        return Response(NAME, s1)
    q2, s2_s = speed_quotas(new, health, hw, num_mb)
    moves = state_moves(base, [new.replicas[i] for i in changed], health, hw)
    s2 = Plan("adapt", new, q2, moves, s1_s, s2_s, hw.regroup_s + move_time_s(moves, hw),
              f"{NAME} S2: slow devices gathered into pipelines {list(changed)}, layers repartitioned; "
              f"{s2_s:.3f} s/iter", policy=NAME)
    if not s2_s < s1_s:
        return Response(NAME, s1)
    # ski-rental: rent S1 until its accumulated loss against S2 equals S2's price
    return Response(NAME, s1, s2, s2.one_time_cost_s / (s1_s - s2_s))
