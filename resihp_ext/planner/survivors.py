"""What the survivors of a fail-stop can execute in place, decided from the Layout and a cost model.

Responsible for the executable part of a fail-stop re-plan: which DP replicas survive whole,
which further replicas can be rebuilt from the stage groups of broken ones, how the global batch
is split when replicas differ in speed, the new dense rank of every kept rank (megatron-core's
"tp-dp-pp" order over the new layout), which surviving ranks become spares, and, when no replica
can go on, whether the survivors still hold every (stage, TP shard) so that a checkpoint can be
assembled from them. Pure: the executor in ``megatron/resihp/recovery.py`` carries it out.

Rebuilt replicas (intact stage groups where they stood or at a short stage, or a replica at a
smaller TP degree from groups that lost members) are ``replica_rebuild``'s to find.

Ranks standing by (left out by an earlier plan, alive, holding nothing the job can use) may be
taken back first: each takes the place of a dead rank, so that a replica that lost ranks runs
whole again (``standby_places``), its standbys receiving their state from live holders.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.optimizer_parts import part_sources
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import outgrown_stages
from resihp_ext.planner.moves import NoSurvivingHolder, state_moves
from resihp_ext.planner.replica_rebuild import (balanced_quotas, every_replica_at, holding_key, rebuild_replicas,
                                                repack_replicas, shrink_replicas, worth_adding)
from resihp_ext.planner.standby_places import filled_layout, standby_places
from resihp_ext.shard_map import Transfer


@dataclass(frozen=True)
class SurvivorPlan:
    """Attributes:
        action: "adapt" (continue in place) or "checkpoint-restart".
        kept_replicas: indices of old replicas that continue whole, in new DP order.
        rebuilt_replicas: replicas assembled from stage groups of broken ones (old ranks), after
            the kept ones in DP order: intact groups at their own stage, intact groups that take a
            short stage, then groups that lost ranks running their stage at a smaller TP degree.
        new_rank: old rank -> rank in the new world (kept and rebuilt ranks only).
        spares: surviving ranks that do not continue.
        checkpoint_writers: (stage, tp_rank) -> surviving old rank that holds that shard.
        missing_shards: (stage, tp_rank) positions no survivor holds (a checkpoint is impossible).
        quotas: micro-batches per continuing replica, in DP order, when replicas differ in speed;
            empty means Megatron's even split.
        reason: one readable sentence.
        transfers: the state the moved stage groups and the standbys taken back receive
            (``shard_map.transfers`` from the old layout to ``continuing_layout``, in old ranks,
            priced), empty when no group takes another stage and no standby comes back; the
            executor runs exactly these.
        filled: dead rank -> the standby (a rank outside the old layout) that takes its place;
            ``kept_replicas`` index the old layout with these places filled.
        part_sources: under the distributed optimizer with copies kept, dead rank -> the live
            rank whose copy of its part of the optimizer state the kept ranks receive
            (``resihp_ext.optimizer_parts``); None when the optimizer is not split.
    """

    action: str
    kept_replicas: tuple[int, ...]
    rebuilt_replicas: tuple[ReplicaSpec, ...] = ()
    new_rank: dict[int, int] = field(default_factory=dict)
    spares: tuple[int, ...] = ()
    checkpoint_writers: dict[tuple[int, int], int] = field(default_factory=dict)
    missing_shards: tuple[tuple[int, int], ...] = ()
    quotas: tuple[int, ...] = ()
    reason: str = ""
    transfers: tuple[Transfer, ...] = ()
    filled: dict[int, int] = field(default_factory=dict)
    part_sources: dict[int, int] | None = None

    @property
    def joiners(self) -> tuple[int, ...]:
        """The standbys the plan takes back (ranks outside the old layout), sorted."""
        return tuple(sorted(r for r in self.filled.values() if r in self.new_rank))

    @property
    def new_world_size(self) -> int:
        return len(self.new_rank)

    def to_dict(self) -> dict:
        return {
            "action": self.action,
            "kept_replicas": list(self.kept_replicas),
            "rebuilt_replicas": [rep.to_dict() for rep in self.rebuilt_replicas],
            "new_rank": {str(k): v for k, v in self.new_rank.items()},
            "spares": list(self.spares),
            "checkpoint_writers": {f"{s},{t}": r for (s, t), r in self.checkpoint_writers.items()},
            "missing_shards": [list(p) for p in self.missing_shards],
            "quotas": list(self.quotas),
            "reason": self.reason,
            "transfers": [t.to_dict() for t in self.transfers],
            "filled": {str(k): v for k, v in self.filled.items()},
            "part_sources": None if self.part_sources is None else {str(k): v for k, v in self.part_sources.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> SurvivorPlan:
        return cls(
            action=d["action"],
            kept_replicas=tuple(d["kept_replicas"]),
            rebuilt_replicas=tuple(ReplicaSpec.from_dict(rep) for rep in d.get("rebuilt_replicas", [])),
            new_rank={int(k): int(v) for k, v in d["new_rank"].items()},
            spares=tuple(d["spares"]),
            checkpoint_writers={tuple(int(x) for x in k.split(",")): int(v) for k, v in d["checkpoint_writers"].items()},
            missing_shards=tuple(tuple(p) for p in d["missing_shards"]),
            quotas=tuple(d.get("quotas", ())),
            reason=d["reason"],
            transfers=tuple(Transfer.from_dict(t) for t in d.get("transfers", [])),
            filled={int(k): int(v) for k, v in d.get("filled", {}).items()},
            part_sources=None if d.get("part_sources") is None else
            {int(k): int(v) for k, v in d["part_sources"].items()},
        )


def _ranks_text(replicas: tuple[ReplicaSpec, ...]) -> str:
    """Each replica's ranks by stage, as the plans' reasons write them: ``[0,1 | 4,5]; [2 | 6]``."""
    return "; ".join("[" + " | ".join(",".join(map(str, s.ranks)) for s in r.stages) + "]" for r in replicas)


def _one_shape(layout: Layout) -> bool:
    shapes = {tuple((s.first_layer, s.num_layers, s.tp_degree) for s in r.stages) for r in layout.replicas}
    return len(shapes) == 1


def _continuing(layout: Layout, plan: SurvivorPlan) -> tuple[ReplicaSpec, ...]:
    """The replicas that go on, in old ranks and new DP order: kept whole, then rebuilt."""
    filled = filled_layout(layout, plan.filled)
    return (*(filled.replicas[i] for i in plan.kept_replicas), *plan.rebuilt_replicas)


def continuing_layout(layout: Layout, plan: SurvivorPlan) -> Layout:
    """The plan's new layout in old ranks (``surviving_layout`` renames them for the new world)."""
    return Layout(_continuing(layout, plan), layout.model)


def surviving_layout(layout: Layout, plan: SurvivorPlan) -> Layout:
    """The replicas that go on (kept and rebuilt), ranks renamed as ``plan.new_rank`` says."""
    return continuing_layout(layout, plan).relabel(plan.new_rank)


def moved_groups(layout: Layout, plan: SurvivorPlan) -> tuple[StageSpec, ...]:
    """Stages of the plan's rebuilt replicas whose group held other layers before (state must move)."""
    filled = filled_layout(layout, plan.filled)
    return tuple(stage for replica in plan.rebuilt_replicas for stage in replica.stages
                 if holding_key(filled.stage_spec_of(stage.ranks[0])) != holding_key(stage))


def megatron_order(replicas: tuple[ReplicaSpec, ...]) -> list[int]:
    """Ranks of ``replicas`` in megatron-core's "tp-dp-pp" order: stage, then replica, then TP rank."""
    depth = max(r.num_stages for r in replicas)
    return [rank for p in range(depth) for r in replicas if p < r.num_stages for rank in r.stages[p].ranks]


def _sharded_state_lost(layout: Layout, dead: frozenset[int], lost: tuple[tuple[int, int], ...],
                        copies: bool) -> SurvivorPlan:
    """No in-place plan: dead ranks took parts of their positions' optimizer state with them."""
    survivors = tuple(sorted(set(layout.world_ranks) - dead))
    without = ("and the ranks keeping their copies died too" if copies
               else "which the distributed optimizer splits over data-parallel ranks without a copy")
    return SurvivorPlan(
        action="checkpoint-restart", kept_replicas=(), spares=survivors, missing_shards=lost,
        reason=(f"dead ranks {sorted(dead)} held parts of the optimizer state of stage/TP positions {list(lost)}, "
                f"{without}, so no in-place plan exists"),
    )


def _plan_with_parts(layout: Layout, dead: frozenset[int], copies: bool, hw: HardwareModel | None,
                     health: Health | None, standbys: tuple[int, ...] = (),
                     replica_counts: frozenset[int] | None = None, uniform_tp: bool = False) -> SurvivorPlan:
    """Under the distributed optimizer: whole replicas go on when every dead rank's part of the
    optimizer state has a live copy; the kept ranks then receive the parts of the replicas left out.

    Standbys may take dead ranks' places (``standby_places``), making their replicas whole again.
    Such a plan moves no weights: a standby receives every part of its place's position like a
    kept rank does, and its model parameters are gathered from the main parameters in them.

    With ``uniform_tp``, where no standby makes the replicas whole, every replica may instead be
    re-formed at one smaller TP degree from the live ranks (``_every_replica_smaller``)."""
    if copies:
        sources, lost = part_sources(layout, dead)
    else:
        sources, lost = {}, tuple(sorted({(layout.stage_of(r)[1], layout.tp_rank_of(r)) for r in dead}))
    if lost:
        return _sharded_state_lost(layout, dead, lost, copies)
    plan = _plan_on(layout, dead, False, hw, health, shape=_Shape(replica_counts=replica_counts))
    filled = _with_standbys(layout, dead, standbys, False, hw, health, _Shape(replica_counts=replica_counts)) \
        if standbys else None
    if filled is not None:  # their state is the parts: no weights move
        plan = dataclasses.replace(filled, transfers=())
    if plan.action == "adapt":
        plan = _shares_fit(layout, dead, plan, hw or HardwareModel())
    copied = ", ".join(f"{d}'s on rank {h}" for d, h in sorted(sources.items()))
    if uniform_tp and filled is None:
        smaller = _every_replica_smaller(layout, dead, plan, hw, health, replica_counts)
        if smaller is not None:
            return dataclasses.replace(smaller, part_sources=sources, reason=(
                f"{smaller.reason}; each stage's optimizer state is gathered whole from its parts, the dead ranks' "
                f"from their copies ({copied}), moved to the new TP shards and split anew"))
    if plan.action != "adapt":
        return plan
    return dataclasses.replace(plan, part_sources=sources, reason=(
        f"{plan.reason}; the optimizer state is split anew over the kept replicas, the dead ranks' parts "
        f"from their copies ({copied})"))


def _shares_fit(layout: Layout, dead: frozenset[int], plan: SurvivorPlan, hw: HardwareModel) -> SurvivorPlan:
    """``plan``, or no in-place plan where its fewer replicas give a stage's ranks larger shares of
    the optimizer state than a device holds (``memory.outgrown_stages``): a re-form that would run
    out of memory part way through is worse than a restart from the last checkpoint."""
    after = continuing_layout(layout, plan)
    outgrown = outgrown_stages(layout, after, hw)
    if not outgrown:
        return plan
    return SurvivorPlan(
        action="checkpoint-restart", kept_replicas=(), spares=tuple(sorted(set(layout.world_ranks) - dead)),
        reason=(f"dead ranks {sorted(dead)} leave {after.num_replicas} of {layout.num_replicas} replicas, and each "
                f"rank of stage positions {list(outgrown)} would then hold a share of the optimizer state that takes "
                f"the stage past {hw.device_memory_bytes / 2**30:.3g} GiB a device (--resihp-device-memory-gb), so no "
                f"in-place plan exists"),
    )


# How much shorter an iteration every replica at a smaller TP degree must be predicted to take than
# the whole replicas left give: the re-form moves every rank's state, and the fitted cost model's
# errors run to several percent between plans this close (a 5% gap seen live went either way).
UNIFORM_TP_GAIN = 0.9


def _every_replica_smaller(layout: Layout, dead: frozenset[int], whole: SurvivorPlan, hw: HardwareModel | None,
                           health: Health | None, replica_counts: frozenset[int] | None) -> SurvivorPlan | None:
    """Every replica re-formed at one smaller TP degree from the live ranks (``every_replica_at``),
    at the degree the cost model predicts the shortest iteration for, when that is shorter than
    ``UNIFORM_TP_GAIN`` times ``whole``'s (the plan keeping the whole replicas; any in-place plan
    beats a restart). None otherwise."""
    model, hw = layout.model, hw or HardwareModel()
    if model.global_batch_size is None or not layout.replicas_alike():
        return None
    known = health or Health()
    known = Health(speed=known.speed, slow_links=known.slow_links)
    whole_s = balanced_quotas(_continuing(layout, whole), model, hw, known)[1] if whole.action == "adapt" else math.inf
    best, best_s = None, UNIFORM_TP_GAIN * whole_s
    degree = _degree(layout.replicas[0]) // 2
    while degree >= 1:
        replicas = every_replica_at(layout, dead, degree, hw, known.affected_ranks, replica_counts)
        if replicas:
            quotas, seconds = balanced_quotas(replicas, model, hw, known)
            if seconds < best_s:
                best, best_s = (replicas, quotas), seconds
        degree //= 2
    if best is None:
        return None
    replicas, quotas = best
    new_layout = Layout(replicas, model)
    try:
        moves = state_moves(layout, new_layout, dead, hw)
    except NoSurvivingHolder:
        return None
    new_rank = {old: new for new, old in enumerate(megatron_order(replicas))}
    spares = tuple(r for r in sorted(set(layout.world_ranks) - dead) if r not in new_rank)
    quotas = () if len(set(quotas)) == 1 else tuple(quotas)
    pieces = _ranks_text(replicas)
    broken = [i for i, r in enumerate(layout.replicas) if set(r.ranks) & dead]
    reason = (f"dead ranks {sorted(dead)} broke replicas {broken}; every replica re-formed at TP {_degree(replicas[0])} "
              f"from the live ranks of each stage group ({pieces}; DP {layout.num_replicas} -> {len(replicas)}, "
              f"TP {_degree(layout.replicas[0])} -> {_degree(replicas[0])}), predicted {best_s:.3g} s an iteration"
              + (f" against {whole_s:.3g} s on the whole replicas" if whole.action == "adapt" else "")
              + (f", micro-batches per replica {list(quotas)}" if quotas else "")
              + f"; {len(spares)} surviving ranks become spares")
    return SurvivorPlan(action="adapt", kept_replicas=(), rebuilt_replicas=replicas, new_rank=new_rank, spares=spares,
                        checkpoint_writers=whole.checkpoint_writers, quotas=quotas, reason=reason, transfers=moves)


def plan_survivors(layout: Layout, dead: frozenset[int], move_state: bool = True,
                   hw: HardwareModel | None = None, health: Health | None = None,
                   standbys: tuple[int, ...] = (), sharded_optimizer: bool = False,
                   part_copies: bool = False, keep_tp: bool = False, tp_descending: bool = False,
                   replica_counts: frozenset[int] | None = None, uniform_tp: bool = False) -> SurvivorPlan:
    """Keep every replica none of whose ranks died, rebuild what intact stage groups allow, renumber.

    New ranks follow megatron-core's order over the new layout (for kept whole replicas of a
    layout in that order, this is ascending old rank).

    Args:
        layout: the layout that was running (replicas may differ).
        dead: ranks that failed stop.
        move_state: whether intact groups may take another stage, receiving its state from a
            survivor (the executor moves fp32 weights and Adam moments; under half precision it
            cannot move the fp32 main copies, so it passes False). Groups that lost ranks run
            at a smaller TP degree only when state may move.
        hw: the cost and memory model that decides whether a slower, smaller-TP replica is worth
            adding and how the global batch is split; ``HardwareModel()`` when None.
        health: what is known to be slow among the survivors (fail-slow verdicts acted on before
            this failure, in the same ranks as ``layout``): the batch is split by the continuing
            replicas' speed under it, so a replica with a known slow rank keeps a smaller share.
        standbys: live ranks outside ``layout`` that hold no state (left out by earlier plans), in
            the order to take them back; each may take a dead rank's place (``standby_places``),
            receiving that place's state, when state may move. Those not taken stay out.
        sharded_optimizer: whether each position's optimizer state is split over its data-parallel
            ranks (Megatron's distributed optimizer): then only whole replicas go on (no state
            moves between stages), and only when every dead rank's part survives.
        part_copies: with ``sharded_optimizer``, whether each part has a copy on the next rank of
            its position (``resihp_ext.optimizer_parts``); without copies a dead rank's part is lost.
        keep_tp: no replica runs at a smaller TP degree (a loop whose replicas must stay alike:
            Megatron-LM's under the distributed optimizer, whose parts pair equal buffers); groups
            may still take another stage and standbys dead ranks' places, which keep the replicas'
            shapes.
        tp_descending: replicas at a smaller TP degree only ever follow those at larger ones, in
            DP order (Megatron-LM's loop: its data-parallel rank 0 writes the checkpoint and its
            last rank logs the loss, so the largest degree must lead and the smallest close).
            Groups that lost ranks then run at a smaller degree only beside replicas that are all
            at one degree, and a rebuilt replica that would follow a smaller kept one stays out.
        replica_counts: how many replicas the executor can run the global batch on (None: any). A
            plan keeps the most of those it can, leaving out rebuilt replicas first, then the last
            whole ones (their ranks become spares): under Megatron-LM's interleaved schedule, for
            one, each replica's share must be one the schedule runs.
        uniform_tp: with ``sharded_optimizer`` and copies kept, the survivors may also re-form every
            replica at one smaller TP degree (all alike, as the distributed optimizer needs), each
            stage's optimizer state gathered whole from its parts and resharded by ``transfers``,
            when the cost model predicts a shorter iteration than the whole replicas give.

    Returns:
        A SurvivorPlan. "adapt" needs at least one replica, whole or rebuilt; otherwise
        "checkpoint-restart", with the writers of a checkpoint assembled from survivors when every
        shard survives.
    """
    unknown = set(dead) - set(layout.world_ranks)
    if unknown:
        raise ValueError(f"dead ranks {sorted(unknown)} are not in the layout")
    if sharded_optimizer and dead:
        return _plan_with_parts(layout, frozenset(dead), part_copies, hw, health, tuple(standbys), replica_counts,
                                uniform_tp=uniform_tp and part_copies)
    shape = _Shape(keep_tp, tp_descending, replica_counts)
    plain = _plan_on(layout, frozenset(dead), move_state, hw, health, shape=shape)
    if not (standbys and move_state):
        return plain
    return _with_standbys(layout, frozenset(dead), standbys, move_state, hw, health, shape) or plain


@dataclass(frozen=True)
class _Shape:
    """What the executor lets a fail-stop plan's replicas be (``plan_survivors``' arguments of
    the same names)."""

    keep_tp: bool = False
    tp_descending: bool = False
    replica_counts: frozenset[int] | None = None


def _with_standbys(layout: Layout, dead: frozenset[int], standbys: tuple[int, ...], move_state: bool,
                   hw: HardwareModel | None, health: Health | None, shape: _Shape = _Shape()) -> SurvivorPlan | None:
    """The plan with ``standbys`` in the places of dead ranks (``standby_places``), or None when no
    place can be filled or the filled layout has no in-place plan."""
    places = standby_places(layout, dead, standbys)
    if not places:
        return None
    taken = frozenset(places.values())
    try:
        plan = _plan_on(filled_layout(layout, places), dead - set(places), move_state, hw, health, taken, shape)
    except NoSurvivingHolder:  # a rebuilt group would need a unit only the dead held: plan without them
        return None
    if plan.action != "adapt":
        return None
    joined = sorted(r for r in taken if r in plan.new_rank)
    reason = (f"dead ranks {sorted(dead)}; standing-by ranks {joined} take the places of dead ranks "
              f"{sorted(d for d, r in places.items() if r in joined)} and receive their state; {plan.reason}")
    return dataclasses.replace(plan, filled=places, reason=reason)


def _degree(replica: ReplicaSpec) -> int:
    return replica.stages[0].tp_degree


def _not_above(replicas: tuple[ReplicaSpec, ...], degree: int | None) -> tuple[ReplicaSpec, ...]:
    """The leading ``replicas`` whose TP degrees do not rise, none above ``degree`` (None: any)."""
    kept: list[ReplicaSpec] = []
    for replica in replicas:
        if degree is not None and _degree(replica) > degree:
            break
        kept.append(replica)
        degree = _degree(replica)
    return tuple(kept)


def _within_counts(kept: tuple[int, ...], rebuilt: tuple, counts: frozenset[int]) -> tuple[tuple, tuple, int]:
    """``kept`` and ``rebuilt`` cut to the largest of ``counts`` there are replicas for, rebuilt
    replicas left out first (they moved state), then the last whole ones; and how many were left out."""
    have = len(kept) + len(rebuilt)
    keep = max((c for c in counts if c <= have), default=0)
    rebuilt = rebuilt[:max(0, keep - len(kept))]
    kept = kept[:keep - len(rebuilt)]
    return kept, rebuilt, have - keep


def _plan_on(layout: Layout, dead: frozenset[int], move_state: bool, hw: HardwareModel | None,
             health: Health | None, empty: frozenset[int] = frozenset(), shape: _Shape = _Shape()) -> SurvivorPlan:
    """``plan_survivors`` on ``layout``, where ``empty`` ranks are live but hold no state (standbys
    placed in it): they run where the layout puts them and receive everything they hold."""
    kept = tuple(i for i, r in enumerate(layout.replicas) if not set(r.ranks) & dead)
    if shape.tp_descending:  # largest TP degree first; ``sorted`` keeps the old order among equals
        kept = tuple(sorted(kept, key=lambda i: -_degree(layout.replicas[i])))
    lost = [i for i in range(layout.num_replicas) if i not in kept]
    rebuilt = rebuild_replicas(layout, lost, dead)
    quotas: tuple[int, ...] = ()
    hw = hw or HardwareModel()
    known = health or Health()
    known = Health(speed=known.speed, slow_links=known.slow_links)  # deaths are ``dead``'s to say
    sized = layout.model.global_batch_size is not None
    if move_state:
        rebuilt += repack_replicas(layout, lost, dead, (*(layout.replicas[i] for i in kept), *rebuilt), empty)
        if shape.tp_descending:
            rebuilt = _not_above(rebuilt, min((_degree(layout.replicas[i]) for i in kept), default=None))
        base = (*(layout.replicas[i] for i in kept), *rebuilt)
        shrinks = sized and not shape.keep_tp and not (shape.tp_descending and len({_degree(r) for r in layout.replicas}) > 1)
        shrunk = shrink_replicas(layout, lost, dead, base, hw, empty, known.affected_ranks) if shrinks else ()
        if shape.tp_descending:
            shrunk = _not_above(tuple(sorted(shrunk, key=lambda r: -_degree(r))),
                                min((_degree(r) for r in base), default=None))
        if shrunk:
            shrunk, quotas = worth_adding(base, shrunk, layout.model, hw, known)
            rebuilt += shrunk
    left_out = 0
    if shape.replica_counts is not None:
        kept, rebuilt, left_out = _within_counts(kept, rebuilt, shape.replica_counts)
    continuing = (*(layout.replicas[i] for i in kept), *rebuilt)
    if left_out and quotas:  # weighed for the replicas before the cut: the batch is split again
        quotas = balanced_quotas(continuing, layout.model, hw, known)[0] if len(continuing) > 1 else ()
    slowed = sorted(r for rep in continuing for r in rep.ranks if r in known.affected_ranks)
    # Standbys may restore a replica beside others reshaped before: the batch follows their speeds.
    differ = bool(empty) and not Layout(continuing, layout.model).replicas_alike()
    if (slowed or differ) and sized and not quotas and len(continuing) > 1:
        quotas = balanced_quotas(continuing, layout.model, hw, known)[0]
    writers: dict[tuple[int, int], int] = {}
    for replica in layout.replicas:
        for stage_index, stage in enumerate(replica.stages):
            for tp_rank, rank in enumerate(stage.ranks):
                if rank not in dead and rank not in empty:
                    writers.setdefault((stage_index, tp_rank), rank)
    positions = [(s, t) for s, stage in enumerate(layout.replicas[0].stages) for t in range(stage.tp_degree)]
    # Assembling one checkpoint from several replicas needs them to share a shape.
    missing = tuple(p for p in positions if p not in writers) if _one_shape(layout) else tuple(positions)
    survivors = sorted(set(layout.world_ranks) - dead)
    if not kept and not rebuilt:
        what = (f"survivors still hold every shard; a checkpoint can be assembled from ranks {sorted(set(writers.values()))}"
                if not missing else f"no survivor holds stage/TP shards {list(missing)}")
        return SurvivorPlan(
            action="checkpoint-restart", kept_replicas=(), spares=tuple(survivors), checkpoint_writers=writers,
            missing_shards=missing,
            reason=(f"dead ranks {sorted(dead)} leave no data-parallel replica whole, and no replica can be rebuilt from "
                    f"the stage groups left (a stage has no group that can hold it, or its state has no live holder), "
                    f"so no in-place plan exists; {what}"),
        )
    plan = SurvivorPlan(action="adapt", kept_replicas=kept, rebuilt_replicas=rebuilt, checkpoint_writers=writers)
    order = megatron_order(_continuing(layout, plan))
    new_rank = {old: new for new, old in enumerate(order)}
    spares = tuple(r for r in survivors if r not in new_rank)
    num_stages = {r.num_stages for r in _continuing(layout, plan)}
    how = f"continue in place on replicas {list(kept)}" if kept else "continue in place"
    if rebuilt:
        pieces = _ranks_text(rebuilt)
        how += f"{' plus ' if kept else ' on '}{len(rebuilt)} rebuilt from stage groups of broken replicas ({pieces})"
    if left_out:
        how += (f" ({left_out} more left out: the global batch of {layout.model.num_microbatches} micro-batches "
                f"splits evenly over {len(kept) + len(rebuilt)} replicas)")
    if quotas and len(set(quotas)) == 1:
        quotas = ()  # replicas alike: Megatron's even split
    if quotas:
        how += f", micro-batches per replica {list(quotas)}"
        if slowed:
            how += f" (known slow ranks {slowed})"
    if empty & set(new_rank):  # standbys took the places of dead ranks (``plan_survivors`` says which)
        reason = f"{how} (DP {layout.num_replicas} -> {len(kept) + len(rebuilt)})"
    elif not dead:  # only ranks outside the layout left (joiners of a readmission that did not hold)
        reason = f"no rank of the layout failed; {how} as they were"
    else:
        reason = (f"dead ranks {sorted(dead)} broke replicas {lost}; {how} (DP {layout.num_replicas} -> "
                  f"{len(kept) + len(rebuilt)}, {'/'.join(map(str, sorted(num_stages)))} stages unchanged), global "
                  f"batch kept by re-spreading micro-batches; {len(spares)} surviving ranks become spares")
    plan = SurvivorPlan(action="adapt", kept_replicas=kept, rebuilt_replicas=rebuilt, new_rank=new_rank,
                        spares=spares, checkpoint_writers=writers, quotas=quotas, reason=reason)
    if moved_groups(layout, plan) or empty & set(new_rank):
        plan = dataclasses.replace(plan, transfers=state_moves(layout, continuing_layout(layout, plan), dead | empty,
                                                               hw))
    return plan
