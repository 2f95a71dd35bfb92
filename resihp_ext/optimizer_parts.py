"""Who holds each part of the distributed optimizer's state, and who keeps its copy.

Megatron's distributed optimizer splits the fp32 main parameters and optimizer moments of each
(stage, TP shard) position over the position's data-parallel ranks: every rank holds one part,
and nothing else holds it. A rank's death then takes its part with it, and no replica that
survives whole can go on without it.

So that one death per position can be survived in place, every part has one copy, kept by the
next rank of the same position in data-parallel order (a ring: the last rank's copy is on the
first). This module is the one description of that ring, which the executor follows when it
sends copies after every optimizer update and the survivor planner when it asks whether each
dead rank's part still exists.

A ring needs every replica to split the model alike (the distributed optimizer's own condition);
a position with one data-parallel rank has no copy (nor needs one while its replica lives).
"""

from __future__ import annotations

from collections.abc import Mapping

from resihp_ext.layout import Layout


def part_ring(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks that split ``rank``'s position's optimizer state, in data-parallel order."""
    stage, tp_rank = layout.stage_of(rank)[1], layout.tp_rank_of(rank)
    return tuple(replica.stages[stage].ranks[tp_rank] for replica in layout.replicas)


def copy_holder(layout: Layout, rank: int) -> int | None:
    """The rank that keeps the copy of ``rank``'s part (None: its position has one rank)."""
    ring = part_ring(layout, rank)
    return ring[(ring.index(rank) + 1) % len(ring)] if len(ring) > 1 else None


def copied_owner(layout: Layout, rank: int) -> int | None:
    """Whose part ``rank`` keeps a copy of (None: its position has one rank)."""
    ring = part_ring(layout, rank)
    return ring[ring.index(rank) - 1] if len(ring) > 1 else None


def part_sources(layout: Layout, dead: frozenset[int]) -> tuple[dict[int, int], tuple[tuple[int, int], ...]]:
    """Where each dead rank's part survives.

    Returns:
        (dead rank -> the live rank holding its copy, the (stage, TP rank) positions that lost a
        part with no copy left: its owner and its copy's holder both dead, or no copy kept).
    """
    sources, lost = {}, set()
    for rank in sorted(dead):
        holder = copy_holder(layout, rank)
        if holder is None or holder in dead:
            lost.add((layout.stage_of(rank)[1], layout.tp_rank_of(rank)))
        else:
            sources[rank] = holder
    return sources, tuple(sorted(lost))


def stale_parts(updates: Mapping[int, int], held: Mapping[int, tuple[int, int] | None],
                sources: Mapping[int, int]) -> str | None:
    """Why the surviving parts cannot make one optimizer state, or None when they can.

    Args:
        updates: live rank -> how many optimizer updates its own part has taken.
        held: live rank -> (whose part it keeps a copy of, how many updates that copy has taken),
            or None when it keeps none yet.
        sources: dead rank -> the live rank whose copy stands for its part (``part_sources``).
    """
    counts = set(updates.values())
    if len(counts) > 1:
        behind = sorted(r for r, n in updates.items() if n == min(counts))
        return (f"the live ranks' parts of the optimizer state are at different updates ({sorted(counts)}; "
                f"ranks {behind} behind): a failure struck while the optimizer stepped")
    count = next(iter(counts), 0)
    for dead, holder in sorted(sources.items()):
        copy = held.get(holder)
        if copy is None or copy[0] != dead:
            return f"rank {holder} keeps no copy of dead rank {dead}'s part of the optimizer state"
        if copy[1] != count:
            return (f"the copy of dead rank {dead}'s part of the optimizer state (on rank {holder}) is of update "
                    f"{copy[1]}, the survivors' parts of update {count}: the failure struck while copies were sent")
    return None
