"""Who holds which slice of which parameter group, and which slices must move between layouts.

Responsible for the one description of shard ownership, as ``schedule.py`` is for schedules: for
a Layout, who holds each item's units (``holders``) and which rank sets sum each gradient
(``sync_sets``, ``sync_rank_sets``); for two Layouts, the transfers that turn one's placement into
the other's (``transfers``). The planner prices exactly these transfers, a Plan carries them, the
executor runs exactly them, and the executor's gradient-sync groups are ``sync_rank_sets``.

An *item* is a group of parameters that always lives together: ``("layer", g)`` for the model's
transformer layer ``g`` (megatron-core's number, wherever the interleaved schedule places it:
``Layout.held_layers``), ``("first",)`` for what the first stage adds (embeddings), ``("last",)`` for what the
last stage adds (final norm, output layer). A TP-partitioned tensor of an item is cut into
``grid`` equal *units* along its partition dimension (``grid`` a power of two >= every TP degree
involved); a rank at TP degree ``k`` and TP rank ``i`` holds units ``[i*grid/k, (i+1)*grid/k)``.
Replicated tensors (norms, row-parallel biases) are one unit held whole by every TP rank.
Nothing here touches tensors or processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resihp_ext.layout import Layout

Item = tuple


class NoLiveHolder(ValueError):
    """A unit that no live rank holds: only a checkpoint can restore it."""


@dataclass(frozen=True, slots=True)
class Holding:
    rank: int
    replica: int
    tp_degree: int
    tp_rank: int


def items(num_layers: int) -> tuple[Item, ...]:
    return (("first",), *(("layer", g) for g in range(num_layers)), ("last",))


def holders(layout: Layout) -> dict[Item, tuple[Holding, ...]]:
    """Every rank holding each item, replicas in order, TP ranks in order."""
    out: dict[Item, list[Holding]] = {item: [] for item in items(layout.model.num_layers)}
    for r, replica in enumerate(layout.replicas):
        last = replica.num_stages - 1
        for p, (stage, layers) in enumerate(zip(replica.stages, layout.held_layers(r))):
            held = [("layer", g) for g in layers]
            if p == 0:
                held.append(("first",))
            if p == last:
                held.append(("last",))
            for item in held:
                out[item].extend(Holding(rank, r, stage.tp_degree, t) for t, rank in enumerate(stage.ranks))
    return {item: tuple(hs) for item, hs in out.items()}


def finest_degree(hs: tuple[Holding, ...]) -> int:
    return max(h.tp_degree for h in hs)


def unit_range(h: Holding, grid: int) -> range:
    width = grid // h.tp_degree
    return range(h.tp_rank * width, (h.tp_rank + 1) * width)


def sync_sets(layout: Layout) -> dict[tuple[Item, int], tuple[int, ...]]:
    """(item, unit of the item's finest grid) -> sorted ranks whose gradients must be summed.

    For replicated tensors use unit 0's set restricted as the caller needs: every holder of the
    item holds them (see ``replicated_sync_set``).
    """
    out = {}
    for item, hs in holders(layout).items():
        grid = finest_degree(hs)
        for unit in range(grid):
            out[(item, unit)] = tuple(sorted(h.rank for h in hs if unit in unit_range(h, grid)))
    return out


def replicated_sync_set(layout: Layout, item: Item) -> tuple[int, ...]:
    return tuple(sorted(h.rank for h in holders(layout)[item]))


def sync_rank_sets(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Every rank set some gradient is summed over (TP units and replicated tensors), sorted; the
    executor builds one process group per set (a set of one rank needs none)."""
    sets = set(sync_sets(layout).values()) | {replicated_sync_set(layout, item) for item in holders(layout)}
    return tuple(sorted(s for s in sets if len(s) > 1))


@dataclass(frozen=True, slots=True)
class Transfer:
    """Unit ``unit`` (of ``grid``) of every tensor of ``item`` goes from old rank ``src`` to ``dst``.

    ``replicated`` transfers carry the item's replicated tensors (one per destination). A transfer
    with ``src == dst`` is a local copy into the rebuilt model. ``num_bytes``: the state it
    carries, as the planner priced it (0 until priced; ``resihp_ext.planner.moves.priced``)."""

    item: Item
    unit: int
    grid: int
    src: int
    dst: int
    replicated: bool = False
    num_bytes: int = 0

    @property
    def crosses(self) -> bool:
        """Whether it goes between two ranks (a local copy costs no link time)."""
        return self.src != self.dst

    @property
    def what(self) -> tuple:
        """What moves where, without its price: the executor's record of a transfer it ran."""
        return self.item, self.unit, self.grid, self.src, self.dst, self.replicated

    def to_dict(self) -> dict[str, Any]:
        return {"item": list(self.item), "unit": self.unit, "grid": self.grid, "src": self.src, "dst": self.dst,
                "replicated": self.replicated, "num_bytes": self.num_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Transfer":
        return cls(tuple(d["item"]), int(d["unit"]), int(d["grid"]), int(d["src"]), int(d["dst"]),
                   bool(d["replicated"]), int(d.get("num_bytes", 0)))


def transfers(old: Layout, new: Layout, dead: frozenset[int] = frozenset()) -> tuple[Transfer, ...]:
    """Every slice each rank of ``new`` needs, and from which live rank of ``old`` it comes.

    Ranks are the same processes in both layouts (renumbering, if any, is the caller's). A rank
    keeps what it already holds (src == dst); otherwise the source is the lowest live holder,
    preferring one in the destination's own old replica.

    Raises:
        NoLiveHolder: a needed slice has no live holder in ``old`` (no in-place plan).
    """
    old_h, new_h = holders(old), holders(new)
    out: list[Transfer] = []
    for item in items(new.model.num_layers):
        sources = [h for h in old_h[item] if h.rank not in dead]
        grid = max(finest_degree(old_h[item]), finest_degree(new_h[item]))
        for h in new_h[item]:
            for unit in unit_range(h, grid):
                have = [s for s in sources if unit in unit_range(s, grid)]
                if not have:
                    raise NoLiveHolder(f"no live rank holds unit {unit}/{grid} of {item}")
                out.append(Transfer(item, unit, grid, _pick(have, h, old).rank, h.rank))
            whole = [s for s in sources]
            out.append(Transfer(item, 0, 1, _pick(whole, h, old).rank, h.rank, replicated=True))
    return tuple(out)


def _pick(candidates: list[Holding], dst: Holding, old: Layout) -> Holding:
    for c in candidates:
        if c.rank == dst.rank:
            return c
    dst_replica = old.replica_of(dst.rank) if old.contains(dst.rank) else None
    same = [c for c in candidates if c.replica == dst_replica]
    return min(same or candidates, key=lambda c: c.rank)
