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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class HeldCopy:
    """The copy a live rank keeps of another rank's part.

    Attributes:
        owner: whose part it is.
        updates: how many optimizer updates the copy has taken.
        earlier: the update count of the copy it replaced (kept until the next one arrives), or
            None when it replaced none.
    """

    owner: int
    updates: int
    earlier: int | None = None


@dataclass(frozen=True)
class PartsAgreement:
    """The optimizer update that every surviving part, and the copy of every dead rank's, is
    brought to: the lowest one any of them stands at.

    Attributes:
        update: the update count the re-formed world's optimizer state is of.
        undone: live ranks whose part took one update more; they take back their part as it was
            before that update (and their Adam step counts), and the iteration runs again.
        earlier_copies: dead ranks whose part is the copy its holder kept before the last one.
    """

    update: int
    undone: tuple[int, ...] = ()
    earlier_copies: tuple[int, ...] = ()


def agree_on_update(updates: Mapping[int, int], before: Mapping[int, int | None],
                    held: Mapping[int, HeldCopy | None], sources: Mapping[int, int]) -> PartsAgreement | str:
    """The update every surviving part can be brought to, or why none can.

    A failure can strike between two ranks' updates (while the optimizer steps) or between a rank's
    update and its copy reaching the holder; the parts then stand at two neighbouring updates. The
    ranks ahead go back one update (each keeps its part as it was before its last update), and a dead
    rank's copy is the one its holder kept before the last one when that one is ahead.

    Args:
        updates: live rank -> how many optimizer updates its own part has taken.
        before: live rank -> the update count of its part as kept from before its last update, or
            None when it keeps none.
        held: live rank -> the copy it keeps, or None when it keeps none yet.
        sources: dead rank -> the live rank whose copy stands for its part (``part_sources``).
    """
    copies = {}
    for dead, holder in sorted(sources.items()):
        copy = held.get(holder)
        if copy is None or copy.owner != dead:
            return f"rank {holder} keeps no copy of dead rank {dead}'s part of the optimizer state"
        copies[dead] = copy
    counts = [*updates.values(), *(copy.updates for copy in copies.values())]
    if not counts:
        return PartsAgreement(0)
    update = min(counts)
    undone = []
    for rank, count in sorted(updates.items()):
        if count == update:
            continue
        if before.get(rank) != update:
            return (f"rank {rank}'s part of the optimizer state is of update {count} and keeps none of update "
                    f"{update}, where the others stand: the failure struck while the optimizer stepped")
        undone.append(rank)
    earlier = []
    for dead, copy in copies.items():
        if copy.updates == update:
            continue
        if copy.earlier != update:
            return (f"the copy of dead rank {dead}'s part of the optimizer state (on rank {sources[dead]}) is of "
                    f"update {copy.updates}, none of update {update}, where the survivors' parts stand: the failure "
                    f"struck while copies were sent")
        earlier.append(dead)
    return PartsAgreement(update, tuple(undone), tuple(earlier))
