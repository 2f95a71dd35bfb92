"""Greyhound: fail-slow mitigation by micro-batch redistribution, then topology adjustment, then restart.

Model of the multi-level mitigation of T. Wu, W. Wang et al., "Greyhound: Hunting Fail-Slows in
Hybrid-Parallel Training at Scale" (USENIX ATC 2025; preprint "FALCON", arXiv:2410.12588).
Greyhound escalates through four levels: S1 does nothing; S2 redistributes micro-batches across
data-parallel replicas by their measured speed (free: only the data split changes); S3 adjusts
the parallel topology; S4 is a checkpoint-restart without the slow nodes. Each costly level is
bought by the ski-rental rule: keep "renting" the level in force until the time it has lost
against the costlier one equals that one's one-time cost, then "buy" it (deterministic
ski-rental, never worse than twice the offline optimum, without knowing how long the slowdown
lasts).

Modelled here: S2 at once (S1 loses time and S2 costs nothing, so ski-rental leaves S1 at once).
S3: slow devices swap places with healthy ones so that they gather in as few pipelines (and,
inside them, as few TP groups) as possible, those pipelines' layers are repartitioned by stage
speed, and S2's split runs on top; it costs a regroup plus the state the moved ranks receive.
S4: ``peers.checkpoint_restart`` excluding the slow nodes (restart time plus a checkpoint
written first). Of S3 and S4, the one whose break-even comes first is the one bought.

Simplified, and why:
- Greyhound mitigates fail-slow only. A fail-stop is handed to checkpoint-restart; slowdowns on
  the restarted nodes then get S2 and S3 as usual.
- S3's communication-aware part (moving traffic off a slow link) is not modelled: slow links get
  S2 only, which can only disfavour Greyhound on slow-link scenarios.
- After buying one level Greyhound does not escalate further within the same slowdown (two
  levels of the ladder, not three).
- The slowdown is known exactly when it starts (detection delay is charged to nobody).
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
    """Greyhound's response to ``health``: S2 now, S3 or S4 when the ski-rental rule says so.

    Args:
        layout: the layout running now.
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: unused (ski-rental needs no horizon); kept for the shared signature.
        current_quotas: micro-batches per replica now (default: equal).

    Returns:
        A Response whose ``first`` is S2 (after a restart when a device is dead) and whose ``then`` is
        S3 or S4 when one of them is faster.
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
              f"{NAME} S2: micro-batches by replica speed {list(quotas)}; {s1_s:.3f} s/iter", policy=NAME)
    swapped, changed = gather_slow(base, health)
    new = swapped.with_replicas(_repartitioned(rep, swapped, health, hw) if i in changed else rep
                                for i, rep in enumerate(swapped.replicas))
    options = []
    if changed:
        q2, s2_s = speed_quotas(new, health, hw, num_mb)
        moves = state_moves(base, new.with_replicas(new.replicas[i] for i in changed), health.dead, hw)
        options.append(Plan("adapt", new, q2, moves, s1_s, s2_s, hw.regroup_s + move_time_s(moves, hw),
                            f"{NAME} S3: slow devices gathered into pipelines {list(changed)}, layers repartitioned; "
                            f"{s2_s:.3f} s/iter", policy=NAME))
    if not health.dead:
        # S4: a planned restart without the slow nodes (a checkpoint is written first)
        restart = checkpoint_restart(layout, Health(dead=frozenset(health.affected_ranks)), hw,
                                     num_microbatches=num_mb, lost_work_s=0.0).first
        if restart.layout is not None:
            q4, s4_s = speed_quotas(restart.layout, health, hw, num_mb)
            options.append(dataclasses.replace(restart, quotas=q4, iteration_s_before=s1_s, iteration_s_after=s4_s,
                                               reason=f"{NAME} S4: {restart.reason}", policy=NAME))
    # ski-rental: rent S2 until its accumulated loss against a level equals that level's price;
    # the level that breaks even first is bought
    faster = [(p.one_time_cost_s / (s1_s - p.iteration_s_after), p) for p in options if p.iteration_s_after < s1_s]
    if not faster:
        return Response(NAME, s1)
    switch, then = min(faster, key=lambda item: item[0])
    return Response(NAME, s1, then, switch)
