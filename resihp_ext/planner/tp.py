"""TP device exclusion: which surviving devices of one TP group keep serving it.

Responsible for enumerating power-of-two subsets of a stage's surviving devices that divide the
heads, FFN size and vocabulary and fit in memory, and ranking them by effective speed. With
perfect TP efficiency and healthy links the score is ``k * min(speed)``, the rule of the ResiHP
paper; with ``tp_efficiency < 1`` the communication share of a wider group, and any slow link
inside it, lower the score. Devices left out become spares. It never changes a Layout itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from resihp_ext.layout import ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import max_layers_on_stage


@dataclass(frozen=True)
class TpChoice:
    """A TP group for one stage: chosen ranks (original TP order), the spares, and its speed.

    ``s_per_tp1_s`` converts TP=1 speed-1 seconds of work into this group's seconds.
    """

    ranks: tuple[int, ...]
    spares: tuple[int, ...]
    s_per_tp1_s: float
    max_layers: int

    @property
    def tp_degree(self) -> int:
        return len(self.ranks)

    @property
    def score(self) -> float:
        """Effective speed relative to one healthy TP=1 device."""
        return 1.0 / self.s_per_tp1_s


def group_time_factor(ranks: Sequence[int], health: Health, hw: HardwareModel) -> float:
    """Seconds this TP group needs per TP=1, speed-1 second of work.

    The compute share runs at the slowest member's speed (TP ranks wait for each other); the
    communication share runs at the slowest link inside the group (a ring is as fast as its
    slowest hop).
    """
    k = len(ranks)
    min_speed = min(health.speed_of(r) for r in ranks)
    if min_speed <= 0.0:
        return float("inf")
    share = hw.comm_share(k)
    link = 1.0
    if share > 0.0 and health.slow_links:
        members = set(ranks)
        link = min((v for (a, b), v in health.slow_links.items() if a in members and b in members), default=1.0)
    return 1.0 / (k * min_speed) + share / (k * (1.0 - share) * link)


def tp_candidates(
    ranks: Sequence[int],
    health: Health,
    model: ModelSpec,
    hw: HardwareModel,
    *,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    min_layers: int = 1,
    dp_degree: int = 1,
) -> tuple[TpChoice, ...]:
    """Feasible TP groups for one stage, best score first.

    For each power-of-two size ``k`` the best subset by ``k * min(speed)`` is the ``k`` fastest
    survivors; when a slow link lies inside the group, subsets leaving out either end of it are
    tried as well.

    Args:
        ranks: the stage's current TP group, in TP-rank order.
        health: speeds, dead ranks, slow links.
        model: model facts (divisibility, memory).
        hw: cost and memory constants.
        stage: stage index in its replica.
        num_stages: pipeline depth of the replica.
        num_microbatches: micro-batches the replica runs (bounds in-flight activations).
        min_layers: the group must fit at least this many layers in memory.
        dp_degree: the stage's data-parallel degree (``memory.stage_memory_bytes``).

    Returns:
        Candidates sorted by descending score, then larger TP degree; empty if none is feasible.
    """
    order = {r: i for i, r in enumerate(ranks)}
    alive = [r for r in ranks if r not in health.dead]
    bases = [alive]
    for (a, b), v in health.slow_links.items():
        if v < 1.0 and a in order and b in order:
            bases += [[r for r in alive if r != a], [r for r in alive if r != b]]
    seen: set[tuple[int, ...]] = set()
    out: list[TpChoice] = []
    for base in bases:
        by_speed = sorted(base, key=lambda r: (-health.speed_of(r), order[r]))
        k = 1
        while k <= len(by_speed):
            chosen = tuple(sorted(by_speed[:k], key=order.__getitem__))
            k *= 2
            if chosen in seen or model.check_tp_degree(len(chosen)):
                continue
            seen.add(chosen)
            cap = max_layers_on_stage(model, hw, tp_degree=len(chosen), stage=stage, num_stages=num_stages,
                                      num_microbatches=num_microbatches, dp_degree=dp_degree)
            if cap < min_layers:
                continue
            spares = tuple(r for r in alive if r not in chosen)
            out.append(TpChoice(chosen, spares, group_time_factor(chosen, health, hw), cap))
    out.sort(key=lambda c: (-c.score, -c.tp_degree))
    return tuple(out)


def choose_tp(ranks: Sequence[int], health: Health, model: ModelSpec, hw: HardwareModel, **kwargs) -> TpChoice | None:
    """The best-scoring feasible TP group for a stage, or None (see ``tp_candidates``)."""
    found = tp_candidates(ranks, health, model, hw, **kwargs)
    return found[0] if found else None
