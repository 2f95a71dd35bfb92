"""What the survivors of a fail-stop can execute in place, decided from the Layout alone.

Responsible for the executable part of a fail-stop re-plan: which DP replicas survive whole,
the new dense rank of every kept rank (megatron-core's "tp-dp-pp" order over the kept replicas),
which surviving ranks become spares, and, when no replica survives whole, whether the survivors
still hold every (stage, TP shard) so that a checkpoint can be assembled from them. Pure: the
executor in ``megatron/training/recovery.py`` carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec


@dataclass(frozen=True)
class SurvivorPlan:
    """Attributes:
        action: "adapt" (continue in place on ``kept_replicas``) or "checkpoint-restart".
        kept_replicas: indices of old replicas that continue, in new DP order.
        new_rank: old rank -> rank in the new world (kept ranks only).
        spares: surviving ranks that do not continue (their replica lost a member).
        checkpoint_writers: (stage, tp_rank) -> surviving old rank that holds that shard.
        missing_shards: (stage, tp_rank) positions no survivor holds (a checkpoint is impossible).
        reason: one readable sentence.
    """

    action: str
    kept_replicas: tuple[int, ...]
    new_rank: dict[int, int] = field(default_factory=dict)
    spares: tuple[int, ...] = ()
    checkpoint_writers: dict[tuple[int, int], int] = field(default_factory=dict)
    missing_shards: tuple[tuple[int, int], ...] = ()
    reason: str = ""

    @property
    def new_world_size(self) -> int:
        return len(self.new_rank)

    def to_dict(self) -> dict:
        return {
            "action": self.action,
            "kept_replicas": list(self.kept_replicas),
            "new_rank": {str(k): v for k, v in self.new_rank.items()},
            "spares": list(self.spares),
            "checkpoint_writers": {f"{s},{t}": r for (s, t), r in self.checkpoint_writers.items()},
            "missing_shards": [list(p) for p in self.missing_shards],
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SurvivorPlan:
        return cls(
            action=d["action"],
            kept_replicas=tuple(d["kept_replicas"]),
            new_rank={int(k): int(v) for k, v in d["new_rank"].items()},
            spares=tuple(d["spares"]),
            checkpoint_writers={tuple(int(x) for x in k.split(",")): int(v) for k, v in d["checkpoint_writers"].items()},
            missing_shards=tuple(tuple(p) for p in d["missing_shards"]),
            reason=d["reason"],
        )


def _one_shape(layout: Layout) -> bool:
    shapes = {tuple((s.first_layer, s.num_layers, s.tp_degree) for s in r.stages) for r in layout.replicas}
    return len(shapes) == 1


def surviving_layout(layout: Layout, plan: SurvivorPlan) -> Layout:
    """The kept replicas of ``layout``, ranks renamed as ``plan.new_rank`` says."""
    return Layout(tuple(
        ReplicaSpec(tuple(StageSpec(s.first_layer, s.num_layers, tuple(plan.new_rank[r] for r in s.ranks))
                          for s in layout.replicas[i].stages))
        for i in plan.kept_replicas), layout.model)


def plan_survivors(layout: Layout, dead: frozenset[int]) -> SurvivorPlan:
    """Keep every replica none of whose ranks died; renumber; name spares and checkpoint writers.

    Kept ranks are renumbered densely in ascending old rank, which is megatron-core's rank order
    over the kept replicas whenever the old layout was in that order.

    Args:
        layout: the layout that was running (replicas may differ).
        dead: ranks that failed stop.

    Returns:
        A SurvivorPlan. "adapt" needs at least one whole replica; otherwise "checkpoint-restart",
        with the writers of a checkpoint assembled from survivors when every shard survives.
    """
    unknown = set(dead) - set(layout.world_ranks)
    if unknown:
        raise ValueError(f"dead ranks {sorted(unknown)} are not in the layout")
    kept = tuple(i for i, r in enumerate(layout.replicas) if not set(r.ranks) & dead)
    writers: dict[tuple[int, int], int] = {}
    for replica in layout.replicas:
        for stage_index, stage in enumerate(replica.stages):
            for tp_rank, rank in enumerate(stage.ranks):
                if rank not in dead:
                    writers.setdefault((stage_index, tp_rank), rank)
    positions = [(s, t) for s, stage in enumerate(layout.replicas[0].stages) for t in range(stage.tp_degree)]
    # Assembling one checkpoint from several replicas needs them to share a shape.
    missing = tuple(p for p in positions if p not in writers) if _one_shape(layout) else tuple(positions)
    survivors = sorted(set(layout.world_ranks) - dead)
    if not kept:
        what = (f"survivors still hold every shard; a checkpoint can be assembled from ranks {sorted(set(writers.values()))}"
                if not missing else f"no survivor holds stage/TP shards {list(missing)}")
        return SurvivorPlan(
            action="checkpoint-restart", kept_replicas=(), spares=tuple(survivors), checkpoint_writers=writers,
            missing_shards=missing,
            reason=f"dead ranks {sorted(dead)} leave no data-parallel replica whole, so no in-place plan exists; {what}",
        )
    shape = layout.replicas[0]
    num_kept = len(kept)
    kept_ranks = sorted(r for i in kept for r in layout.replicas[i].ranks)
    new_rank = {old: new for new, old in enumerate(kept_ranks)}
    spares = tuple(r for r in survivors if r not in new_rank)
    lost = [i for i in range(layout.num_replicas) if i not in kept]
    return SurvivorPlan(
        action="adapt", kept_replicas=kept, new_rank=new_rank, spares=spares, checkpoint_writers=writers,
        reason=(f"dead ranks {sorted(dead)} broke replicas {lost}; continue in place on replicas {list(kept)} "
                f"(DP {layout.num_replicas} -> {num_kept}, {shape.num_stages} stages unchanged), global batch kept by "
                f"re-spreading micro-batches; {len(spares)} surviving ranks become spares"),
    )
