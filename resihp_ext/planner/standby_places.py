"""Which places of dead ranks standing-by ranks take when a fail-stop recovery plans.

A rank that a fail-stop plan leaves out does not exit: it stands by, holding no state the job
can use (what it held is as old as the iteration it left at). At the next fail-stop the survivor
planner (``survivors.plan_survivors``) may take standbys back: each one takes the place of a dead
rank in a replica that lost ranks, so that replica runs whole again, at its shape and TP degree,
and the standby receives every unit of that place's state from a live holder. This module decides
those places; the survivor planner plans on the layout with them filled, treating the standbys as
live ranks that hold nothing.

Rules:
- a replica is filled only whole (one standby for each of its dead ranks), fewest dead first,
  then in replica order, so the standbys restore as many replicas as they can;
- a replica is filled only when some live rank (never a standby) holds every unit of its state;
- standbys are used in the order given (the executor lists the healthiest first).

Pure: plain Layouts and rank sets in, a Layout and a mapping out; no process group, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from resihp_ext.layout import Layout
from resihp_ext.shard_map import NoLiveHolder, transfers


def filled_layout(layout: Layout, places: dict[int, int]) -> Layout:
    """``layout`` with each dead rank of ``places`` replaced by the standby that takes its place."""
    return layout.relabel({r: places.get(r, r) for r in layout.world_ranks})


def standby_places(layout: Layout, dead: frozenset[int], standbys: Sequence[int]) -> dict[int, int]:
    """The places of dead ranks that ``standbys`` take: dead rank -> standby rank.

    Args:
        layout: the layout that was running.
        dead: ranks that failed stop (every one in ``layout``).
        standbys: live ranks outside ``layout`` that hold no state, in the order to use them.

    Returns:
        Dead rank -> standby; empty when no replica can be made whole.

    Raises:
        ValueError: a standby is a rank of ``layout``, or is named twice.
    """
    clash = set(standbys) & set(layout.world_ranks)
    if clash or len(set(standbys)) != len(standbys):
        raise ValueError(f"standbys {list(standbys)} must be distinct ranks outside the layout "
                         f"(ranks {sorted(clash)} are in it)")
    free = list(standbys)
    places: dict[int, int] = {}
    broken = [(sorted(set(rep.ranks) & dead), i) for i, rep in enumerate(layout.replicas) if set(rep.ranks) & dead]
    for lost, index in sorted(broken, key=lambda b: (len(b[0]), b[1])):
        if len(lost) > len(free):
            continue
        trial = dict(zip(lost, free))
        replica = layout.replicas[index].relabel({r: trial.get(r, r) for r in layout.replicas[index].ranks})
        try:
            # Sources are live ranks of the running layout (a standby is in none: it holds nothing).
            transfers(layout, Layout((replica,), layout.model), dead)
        except NoLiveHolder:
            continue
        places.update(trial)
        free = free[len(lost):]
    return places


__all__ = ["filled_layout", "standby_places"]
