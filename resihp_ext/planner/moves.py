"""State moves implied by a layout change, and what they cost.

Responsible for listing, shard by shard, which rank must copy which piece of model and optimizer
state to which rank so the new layout's ranks hold what they serve, and for estimating the
seconds that takes. Sources are always surviving ranks: the rank's own old replica first, then
any other replica holding the same layer and shard (after a fail-stop that is the only copy).
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import Iterable

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Move


class NoSurvivingHolder(ValueError):
    """A layer shard that no surviving rank holds: only a checkpoint can restore it."""


def _holds(stage: StageSpec, layer: int, num_layers: int) -> bool:
    # -1 is the embedding (on a replica's first stage), num_layers the output layer (its last)
    if layer == -1:
        return stage.first_layer == 0
    if layer == num_layers:
        return stage.end_layer == num_layers
    return stage.first_layer <= layer < stage.end_layer


def _stage_items(stage: StageSpec, num_layers: int) -> list[int]:
    items = list(stage.layers)
    if stage.first_layer == 0:
        items.insert(0, -1)
    if stage.end_layer == num_layers:
        items.append(num_layers)
    return items


def state_moves(
    old: Layout, new_replicas: Iterable[ReplicaSpec], health: Health, hw: HardwareModel
) -> tuple[Move, ...]:
    """The copies that turn ``old``'s state placement into the one ``new_replicas`` need.

    Args:
        old: the layout whose state exists now (dead ranks' state is lost).
        new_replicas: replicas of the layout to run next (all of them, or only the changed ones);
            their ranks are ranks of ``old``.
        health: which ranks are dead.
        hw: bytes per parameter of state.

    Returns:
        Moves, one per finest shard a rank lacks.

    Raises:
        NoSurvivingHolder: a needed shard survives nowhere.
    """
    model = old.model
    num_layers = model.num_layers
    layer_params = hw.layer_params(model)
    params_of = {-1: hw.embedding_params(model), num_layers: model.vocab_size * model.hidden_size}

    @lru_cache(maxsize=None)
    def old_stages(layer: int) -> tuple[StageSpec, ...]:
        return tuple(next(st for st in rep.stages if _holds(st, layer, num_layers)) for rep in old.replicas)

    moves: list[Move] = []
    for rep in new_replicas:
        first = rep.stages[0].ranks[0]
        old_r = old.replica_of(first) if old.contains(first) else None
        if old_r is not None and old.replicas[old_r] == rep and not any(r in health.dead for r in rep.ranks):
            continue  # untouched replica: every rank already holds its state
        for st in rep.stages:
            k = st.tp_degree
            for i, dst in enumerate(st.ranks):
                own_stage = old.stage_spec_of(dst) if old.contains(dst) else None
                own_i = old.tp_rank_of(dst) if own_stage is not None else 0
                home = old.replica_of(dst) if own_stage is not None else None
                for layer in _stage_items(st, num_layers):
                    holds = own_stage is not None and dst not in health.dead and _holds(own_stage, layer, num_layers)
                    if holds and own_stage.tp_degree == k and own_i == i:
                        continue
                    holders = old_stages(layer)
                    finest = max(k, max(h.tp_degree for h in holders))
                    need = set(range(i * finest // k, (i + 1) * finest // k))
                    if holds:
                        k0 = own_stage.tp_degree
                        need -= set(range(own_i * finest // k0, (own_i + 1) * finest // k0))
                    order = ([home] if home is not None else []) + [r for r in range(len(holders)) if r != home]
                    for shard in sorted(need):
                        src = None
                        for r in order:
                            h = holders[r]
                            cand = h.ranks[shard // (finest // h.tp_degree)]
                            if cand not in health.dead:
                                src = cand
                                break
                        if src is None:
                            raise NoSurvivingHolder(
                                f"layer {layer} shard {shard}/{finest} has no surviving holder in any replica"
                            )
                        num_params = params_of.get(layer, layer_params) / finest
                        moves.append(Move("tp_shard" if holds else "layer", layer, shard, finest, src, dst,
                                          int(num_params * hw.state_bytes_per_param)))
    return tuple(moves)


def move_time_s(moves: tuple[Move, ...], hw: HardwareModel) -> float:
    """Seconds to perform ``moves`` in parallel: the busiest sender's or receiver's bytes / bandwidth."""
    if not moves:
        return 0.0
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for m in moves:
        sent[m.src_rank] += m.num_bytes
        received[m.dst_rank] += m.num_bytes
    return max(max(sent.values()), max(received.values())) / hw.link_bandwidth_Bps
