"""What a layout change's state transfers cost.

Responsible for pricing the transfers ``resihp_ext.shard_map.transfers`` lists between two
layouts (the one rule for who sends which shard; the executor runs exactly the priced list a Plan
carries) and for the seconds they take. Sources are always live ranks: the destination itself
when it already holds a unit, then a holder in its own old replica, then any other (after a
fail-stop that is the only copy).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.shard_map import Item, NoLiveHolder, Transfer, transfers

# The planner's name for a shard that only a checkpoint can restore.
NoSurvivingHolder = NoLiveHolder


def item_params(item: Item, model: ModelSpec, hw: HardwareModel) -> int:
    """Parameters of one item: a transformer layer, the first stage's embeddings, or the last
    stage's output layer."""
    if item[0] == "layer":
        return hw.layer_params(model)
    if item[0] == "first":
        return hw.embedding_params(model)
    return model.vocab_size * model.hidden_size


def priced(moves: Iterable[Transfer], model: ModelSpec, hw: HardwareModel) -> tuple[Transfer, ...]:
    """``moves`` with the bytes of state each carries (weights, grads, main copy, Adam moments).

    A unit carries its item's parameters over the grid; a replicated transfer (norms and biases,
    a few vectors beside the matrices) is counted within its item's units and priced 0.
    """
    return tuple(dataclasses.replace(
        t, num_bytes=0 if t.replicated else int(item_params(t.item, model, hw) / t.grid * hw.state_bytes_per_param))
        for t in moves)


def state_moves(old: Layout, new: Layout, dead: frozenset[int], hw: HardwareModel) -> tuple[Transfer, ...]:
    """The priced transfers that turn ``old``'s state placement into the one ``new`` needs.

    Args:
        old: the layout whose state exists now (dead ranks' state is lost).
        new: the layout (or some replicas of it, as a Layout) to run next; its ranks are the same
            processes as ``old``'s, and ranks ``old`` lacks hold nothing yet.
        dead: ranks whose state is lost.
        hw: bytes per parameter of state.

    Returns:
        Every transfer ``shard_map.transfers`` lists, local copies included, priced.

    Raises:
        NoSurvivingHolder: a needed shard survives nowhere.
    """
    return priced(transfers(old, new, frozenset(dead)), old.model, hw)


def move_time_s(moves: Iterable[Transfer], hw: HardwareModel) -> float:
    """Seconds to perform ``moves`` in parallel: the busiest sender's or receiver's bytes / bandwidth
    (local copies cost nothing)."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for m in moves:
        if m.crosses:
            sent[m.src] += m.num_bytes
            received[m.dst] += m.num_bytes
    if not sent:
        return 0.0
    return max(max(sent.values()), max(received.values())) / hw.link_bandwidth_Bps
