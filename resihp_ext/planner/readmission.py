"""Readmission: standby ranks that are healthy again rejoin, and the replicas they left regain their launch shape.

A fail-slow plan may leave a rank out of every replica (TP exclusion of a very slow device; with
one TP degree per replica, its healthy TP siblings on other stages too). Such a rank stands by:
it keeps its process, probes its own speed and reports it through the job's store. This module
decides whether taking standbys back pays off. A launch replica whose ranks are all either
working in replicas inside it or standing by is restored as launched: those working replicas are
replaced by it, the standbys join the world, and the batch is split again by speed. The one-time
cost (regrouping, the state the joiners receive) must pay for itself within the horizon.

Ranks: the running ``layout`` uses this world's ranks; ``identity`` maps each of them to its
launch rank, the stable name of a process across re-formed worlds, which the launch layout and
the standbys use. In the grown world the working ranks keep their numbers and the joiners follow,
in launch-rank order, so nothing that already runs is renumbered.

Pure: the training front end (``megatron.resihp.standby``) gathers the reports and executes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resihp_ext.layout import Layout, ReplicaSpec
from resihp_ext.planner.alike_stages import replica_with_split
from resihp_ext.planner.cost import iteration_s, speed_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.moves import move_time_s, state_moves
from resihp_ext.planner.plan import Plan

POLICY = "readmission"


@dataclass(frozen=True)
class Readmission:
    """A decision on the standbys that report healthy: keep the layout, or grow the world.

    Attributes:
        plan: "keep" (the running layout) or "adapt" to ``plan.layout``, in the grown world's
            ranks; its moves fill the joiners; policy "readmission".
        joiners: launch ranks of the standbys that join, in the order of their new ranks, which
            follow the working ranks'.
    """

    plan: Plan
    joiners: tuple[int, ...] = ()

    def new_rank_of(self, launch_rank: int, world_size: int) -> int:
        """A joiner's rank in the grown world of a job whose current world has ``world_size`` ranks."""
        return world_size + self.joiners.index(launch_rank)


def _restorable(launch: ReplicaSpec, working: set[int], ready: Mapping[int, float],
                current: Sequence[ReplicaSpec]) -> bool:
    """Every rank of ``launch`` works or stands by, one at least stands by, and every working
    replica touching it lies inside it (restoring it then takes ranks from no other replica)."""
    ranks = set(launch.ranks)
    if not ranks <= working | set(ready) or not ranks & set(ready):
        return False
    return all(set(rep.ranks) <= ranks for rep in current if set(rep.ranks) & ranks)


def plan_readmission(
    layout: Layout,
    identity: Sequence[int],
    launch_layout: Layout,
    ready: Mapping[int, float],
    health: Health,
    hw: HardwareModel,
    current_quotas: Sequence[int],
    horizon_iters: int,
    alike: bool = False,
    tp_descending: bool = False,
) -> Readmission:
    """Whether to take back the standbys in ``ready``, and the grown layout if so.

    Args:
        layout: the layout running now (this world's ranks ``0 .. len(identity) - 1``).
        identity: this world's rank -> launch rank.
        launch_layout: the layout the job was launched with (launch ranks).
        ready: launch rank of each standby that reported -> its measured slowdown now (>= 1.0).
        health: known slowdowns of the working ranks (this world's ranks).
        hw: the cost model.
        current_quotas: micro-batches per replica now.
        horizon_iters: iterations left to pay the change back.
        alike: every replica must hold one layer split (an executor that builds every replica
            from one model definition): a restored replica takes the running replicas' split
            rather than its launch one.
        tp_descending: replicas at a smaller TP degree only ever follow those at larger ones in
            rank order (``Layout.tp_degrees_descend``; ``survivors.plan_survivors``' rule of the same
            name). The standbys take the ranks after the working ones, so a replica they restore
            whole beside one at a smaller degree would break it; one restored in the place of a
            smaller replica of its own ranks need not.

    Returns:
        A ``Readmission``; "keep" with the reason when no launch replica can be restored or
        restoring does not pay.
    """
    if len(identity) != len(set(identity)):
        raise ValueError(f"identity {list(identity)} names a launch rank twice")
    if set(layout.world_ranks) - set(range(len(identity))):
        raise ValueError(f"layout ranks {sorted(layout.world_ranks)} exceed this world's {len(identity)} ranks")
    clash = set(ready) & set(identity)
    if clash:
        raise ValueError(f"launch ranks {sorted(clash)} are reported standing by but work in this world")
    for rank, factor in ready.items():
        if not factor >= 1.0:
            raise ValueError(f"standby {rank} reports slowdown {factor}; a slowdown is >= 1.0 (1.0 healthy)")
    num_mb = sum(current_quotas)
    before_s = iteration_s(layout, current_quotas, health, hw)

    def keep(why: str) -> Readmission:
        return Readmission(Plan("keep", layout, tuple(current_quotas), (), before_s, before_s, 0.0, f"keep: {why}",
                                policy=POLICY))

    if not ready:
        return keep("no standby reports")
    to_launch = dict(enumerate(identity))
    current = [rep.relabel(to_launch) for rep in layout.replicas]
    working = set(identity)
    restored = [rep for rep in launch_layout.replicas if rep not in current
                and _restorable(rep, working, ready, current)]
    if alike and current:
        restored = [replica_with_split(rep, current[0].layers_per_stage) for rep in restored]
    if not restored:
        return keep(f"standbys {sorted(ready)} complete no launch replica beside the working ones")
    replicas: list[ReplicaSpec] = []
    for rep in current:
        home = next((r for r in restored if set(rep.ranks) <= set(r.ranks)), None)
        if home is None:
            replicas.append(rep)
        elif home not in replicas:
            replicas.append(home)  # where the first replica it replaces ran, so others keep their order
    replicas += [r for r in restored if r not in replicas]  # launch replicas made of standbys only
    joiners = tuple(sorted({r for rep in restored for r in rep.ranks} - working))
    to_new = {launch: rank for rank, launch in enumerate(identity)}
    to_new.update({launch: len(identity) + i for i, launch in enumerate(joiners)})
    grown = Layout(tuple(rep.relabel(to_new) for rep in replicas), layout.model)
    if tp_descending and not grown.tp_degrees_descend():
        return keep(f"standbys {sorted(ready)} would restore a launch replica after one at a smaller TP degree "
                    f"in rank order (the standbys take the ranks after the working ones)")
    grown_health = health.updated(Health(speed={to_new[r]: 1.0 / ready[r] for r in joiners}))
    quotas, after_s = speed_quotas(grown, grown_health, hw, num_mb)
    transfers = state_moves(layout, grown, grown_health.dead, hw)
    cost_s = hw.regroup_s + move_time_s(transfers, hw)
    moves = [t for t in transfers if t.crosses]
    names = ", ".join(f"{r} ({ready[r]:.2f}x)" for r in joiners)
    what = (f"standbys {names} rejoin, restoring launch replicas of ranks "
            f"{[list(r.ranks) for r in restored]} (launch ranks)")
    if not horizon_iters * after_s + cost_s < horizon_iters * before_s:
        return keep(f"{what} would run {after_s:.3f} s/iter after {cost_s:.1f} s against {before_s:.3f} s/iter "
                    f"now; does not pay off within {horizon_iters} iterations")
    gain = "" if not math.isfinite(before_s) else \
        f"; pays back in {cost_s / max(before_s - after_s, 1e-12):.0f} iterations"
    return Readmission(Plan("adapt", grown, quotas, transfers, before_s, after_s, cost_s,
                            f"adapt: {what}; world {len(identity)} -> {grown.world_size}; quotas {list(quotas)}; "
                            f"{before_s:.3f} -> {after_s:.3f} s/iter; {len(moves)} moves, {cost_s:.1f} s{gain}",
                            policy=POLICY), joiners)


__all__ = ["Readmission", "plan_readmission"]
