"""Replicas the survivors of a fail-stop can form from the ranks of broken ones.

Responsible for the three kinds of rebuilt replica ``survivors.plan_survivors`` may add, cheapest
first: intact stage groups at the stage they held (``rebuild_replicas``); leftover intact groups
taking a stage that is short (``repack_replicas``); the live ranks of groups that lost members, as a
replica at one smaller TP degree (``shrink_replicas``), added only when the cost model predicts a
shorter iteration with it (``worth_adding``), the batch then split by speed (``balanced_quotas``).
Where replicas must stay alike (Megatron's distributed optimizer), every replica is re-formed at
one smaller degree instead (``every_replica_at``). No TP group is formed from ranks of different
old groups. Pure.
"""

from __future__ import annotations

import math

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner.cost import speed_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import stage_memory_bytes
from resihp_ext.shard_map import transfers


def holding_key(stage: StageSpec) -> tuple[int, int, int]:
    """What a stage group holds: the same key means the same parameters and optimizer state."""
    return stage.first_layer, stage.num_layers, stage.tp_degree


def _intact_groups(layout: Layout, broken: list[int], dead: frozenset[int]) -> list[tuple[int, StageSpec]]:
    return [(i, stage) for i in broken for stage in layout.replicas[i].stages if not set(stage.ranks) & dead]


def rebuild_replicas(layout: Layout, broken: list[int], dead: frozenset[int]) -> tuple[ReplicaSpec, ...]:
    """Replicas assembled from the intact stage groups of the ``broken`` replicas, at their own stages.

    Each broken replica's shape, in order, is a template; a replica of that shape is built while
    every one of its stages has an unused intact group of the same layers and TP degree. Groups of
    the template replica itself come first (fewer pipelines change), then the lowest ranks.
    """
    free: dict[tuple[int, int, int], list[tuple[int, StageSpec]]] = {}
    for i, stage in _intact_groups(layout, broken, dead):
        free.setdefault(holding_key(stage), []).append((i, stage))
    rebuilt = []
    for template in broken:
        stages = layout.replicas[template].stages
        while all(free.get(holding_key(s)) for s in stages):
            picked = []
            for stage in stages:
                pool = free[holding_key(stage)]
                choice = min(pool, key=lambda g: (g[0] != template, min(g[1].ranks)))
                pool.remove(choice)
                picked.append(choice[1])
            rebuilt.append(ReplicaSpec(tuple(picked)))
    return tuple(rebuilt)


def repack_replicas(layout: Layout, broken: list[int], dead: frozenset[int],
                    continuing: tuple[ReplicaSpec, ...], empty: frozenset[int] = frozenset()
                    ) -> tuple[ReplicaSpec, ...]:
    """Further replicas from intact stage groups left over, each group taking whatever stage is short.

    A group placed at a stage it did not hold receives that stage's state (weights and optimizer
    moments) from a surviving holder. Groups keep their TP degree and members, so no TP group
    spans new links. A replica is added only while some survivor holds every unit of its state
    (``empty``: live ranks that hold none, standbys taken back).
    """
    used = {r for replica in continuing for r in replica.ranks}
    free = [stage for _, stage in _intact_groups(layout, broken, dead) if not set(stage.ranks) & used]
    repacked: list[ReplicaSpec] = []
    for template in broken:
        shape = layout.replicas[template].stages
        while True:
            pool, picked = list(free), []
            for stage in shape:
                fits = [g for g in pool if g.tp_degree == stage.tp_degree]
                if not fits:
                    break
                # A group that already holds this stage moves nothing; otherwise the lowest ranks.
                choice = min(fits, key=lambda g: (holding_key(g) != holding_key(stage), min(g.ranks)))
                pool.remove(choice)
                picked.append(StageSpec(stage.first_layer, stage.num_layers, choice.ranks))
            if len(picked) < len(shape):
                break
            candidate = ReplicaSpec(tuple(picked))
            if not _has_live_holders(layout, candidate, dead | empty):
                break
            repacked.append(candidate)
            free = pool
    return tuple(repacked)


def _has_live_holders(layout: Layout, replica: ReplicaSpec, dead: frozenset[int]) -> bool:
    """Whether some survivor holds every unit of ``replica``'s state (its own needs only)."""
    try:
        transfers(layout, Layout((replica,), layout.model), dead)
    except ValueError:
        return False
    return True


def _runs_at(degree: int, stage: StageSpec, position: int, num_stages: int, model: ModelSpec,
             hw: HardwareModel, dp_degree: int = 1) -> bool:
    """Whether ``degree`` ranks can run ``stage``: the heads split evenly, and its shard fits a device
    (``dp_degree``: the stage's data-parallel degree, over which a distributed optimizer splits its state)."""
    need = stage_memory_bytes(model, hw, num_layers=stage.num_layers, tp_degree=degree, stage=position,
                              num_stages=num_stages, num_microbatches=model.num_microbatches, dp_degree=dp_degree)
    return model.check_tp_degree(degree) is None and need <= hw.device_memory_bytes


def shrink_replicas(layout: Layout, broken: list[int], dead: frozenset[int], continuing: tuple[ReplicaSpec, ...],
                    hw: HardwareModel, empty: frozenset[int] = frozenset(),
                    slow: frozenset[int] = frozenset()) -> tuple[ReplicaSpec, ...]:
    """Further replicas from the live ranks left in broken replicas' stage groups, at a smaller TP degree.

    Each stage of such a replica is run by ranks of one old group (so no TP group spans new
    links), at one TP degree for the whole replica: megatron-core pairs pipeline neighbours by TP
    rank, so stages of one pipeline share a degree. The degree is the largest power of two that
    the groups left have enough live ranks for, that divides the attention heads and whose shards
    fit ``hw.device_memory_bytes``. A group serves the stage it held when it can (it keeps that
    stage's TP units and receives only the ones it lacks), otherwise a stage that is short, whose
    state it receives. A group with more live ranks than the degree is split: its other ranks
    stay available, so one old group can serve several replicas (a TP-4 group that lost a rank
    gives a TP-2 replica its stage and a TP-1 replica too). A replica is made while groups are
    left for every stage of a broken replica's shape and some survivor holds its whole state
    (``empty``: live ranks that hold none, standbys taken back, used after a group's other ranks;
    ``slow``: ranks known to be slow, used after a group's healthy ones).
    """
    used = {r for replica in continuing for r in replica.ranks}
    pool: list[tuple[tuple[int, int], tuple[int, ...]]] = []  # (layers held, live unused ranks)
    for i in broken:
        for stage in layout.replicas[i].stages:
            ranks = tuple(sorted((r for r in stage.ranks if r not in dead and r not in used),
                                 key=lambda r: (r in empty, r in slow)))
            if ranks:
                pool.append(((stage.first_layer, stage.num_layers), ranks))

    def assign(shape: tuple[StageSpec, ...], degree: int) -> list[tuple[tuple[int, int], tuple[int, ...]]] | None:
        free, picked = [g for g in pool if len(g[1]) >= degree], []
        for stage in shape:
            if not free:
                return None
            key = (stage.first_layer, stage.num_layers)
            # Its own stage first (less to move), then the group with the fewest ranks (fewer idle).
            choice = min(free, key=lambda g: (g[0] != key, len(g[1]), g[1]))
            free.remove(choice)
            picked.append(choice)
        return picked

    shrunk: list[ReplicaSpec] = []
    for template in broken:
        shape = layout.replicas[template].stages
        while True:
            degree, picked = shape[0].tp_degree, None
            while degree and picked is None:
                if all(_runs_at(degree, s, p, len(shape), layout.model, hw) for p, s in enumerate(shape)):
                    picked = assign(shape, degree)
                if picked is None:
                    degree //= 2
            if picked is None:
                break
            candidate = ReplicaSpec(tuple(StageSpec(s.first_layer, s.num_layers, g[1][:degree])
                                          for s, g in zip(shape, picked)))
            if not _has_live_holders(layout, candidate, dead | empty):
                break
            for held, ranks in picked:
                pool.remove((held, ranks))
                if ranks[degree:]:  # the group's other ranks may serve a further replica
                    pool.append((held, ranks[degree:]))
            shrunk.append(candidate)
    return tuple(shrunk)


def every_replica_at(layout: Layout, dead: frozenset[int], degree: int, hw: HardwareModel,
                     slow: frozenset[int] = frozenset(),
                     replica_counts: frozenset[int] | None = None) -> tuple[ReplicaSpec, ...]:
    """As many replicas as the live ranks allow with the launch's layer split, every one at
    ``degree`` (a layout whose replicas are alike: under Megatron's distributed optimizer the
    replicas' gradient buffers must pair, so no replica may differ from the others).

    Each stage group of each replica, intact or not, gives its live ranks to groups of ``degree``
    ranks (no TP group spans ranks of different old groups), healthy ranks before ``slow`` ones
    and then the lowest first; replica ``j`` takes the ``j``-th group of every stage, as many as
    the largest of ``replica_counts`` (the counts the executor can run; None: any) allows. No
    replica when ``degree`` does not shard the model or a stage's shard does not fit
    ``hw.device_memory_bytes`` (a distributed optimizer's state split over as many ranks as there
    are replicas).
    """
    shape = layout.replicas[0].stages
    groups: list[list[tuple[int, ...]]] = []
    for position in range(len(shape)):
        formed = []
        for replica in layout.replicas:
            live = sorted((r for r in replica.stages[position].ranks if r not in dead), key=lambda r: (r in slow, r))
            usable = live[:len(live) - len(live) % degree]
            formed += [tuple(sorted(usable[i:i + degree])) for i in range(0, len(usable), degree)]
        # Groups without a slow rank lead, so that the replicas left out hold the slow ones.
        groups.append(sorted(formed, key=lambda g: (bool(set(g) & slow), g)))
    count = min(len(g) for g in groups)
    if replica_counts is not None:
        count = max((c for c in replica_counts if c <= count), default=0)
    if not count or not all(_runs_at(degree, s, p, len(shape), layout.model, hw, count) for p, s in enumerate(shape)):
        return ()
    return tuple(ReplicaSpec(tuple(StageSpec(s.first_layer, s.num_layers, groups[p][j]) for p, s in enumerate(shape)))
                 for j in range(count))


def balanced_quotas(replicas: tuple[ReplicaSpec, ...], model: ModelSpec, hw: HardwareModel,
                    health: Health | None = None) -> tuple[tuple[int, ...], float]:
    """Micro-batches per replica that minimise the predicted iteration under ``health`` (known
    slowdowns of surviving ranks), each replica training at least one, and that iteration's
    seconds (inf when there are more replicas than micro-batches)."""
    if len(replicas) > model.num_microbatches:
        return (), math.inf
    return speed_quotas(Layout(replicas, model), health or Health(), hw, model.num_microbatches)


def worth_adding(base: tuple[ReplicaSpec, ...], extra: tuple[ReplicaSpec, ...], model: ModelSpec,
                 hw: HardwareModel, health: Health | None = None) -> tuple[tuple[ReplicaSpec, ...], tuple[int, ...]]:
    """The replicas of ``extra`` that, added one at a time, shorten the predicted iteration, and
    the quotas of ``base`` plus them (a slower replica helps only if it takes a share of the batch
    worth more than the longer gradient sync it brings)."""
    chosen: tuple[ReplicaSpec, ...] = ()
    quotas, best = balanced_quotas(base, model, hw, health) if base else ((), math.inf)
    for replica in extra:
        trial_quotas, trial = balanced_quotas((*base, *chosen, replica), model, hw, health)
        if trial < best:
            chosen, quotas, best = (*chosen, replica), trial_quotas, trial
    return chosen, quotas
