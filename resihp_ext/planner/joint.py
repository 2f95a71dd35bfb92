"""Joint progressive re-planning across TP, PP and DP: Layout + Health -> Plan.

Responsible for the ResiHP decision. Replicas untouched by the failure keep their layout. For
each affected replica it builds candidates progressively: the replica as it is (only DP quotas
change), the same TP groups with layers repartitioned, TP device exclusion (best-scoring group
per stage, and the widest surviving group per stage) followed by layer repartition, and dropping
the replica. Combinations are ranked with the affine pipeline model and DP quotas; the best few
are scored with the exact 1F1B simulator, charging the one-time cost of moving state against the
gain over ``horizon_iters`` iterations. When no in-place plan exists (a shard no surviving rank
holds, or nothing fits in memory) the plan is "checkpoint-restart" with the reason. Executors
that need every replica alike get quotas alone (``stages_fixed``) or one layer split shared by
every replica (``stages_alike``, searched in ``alike_stages``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.planner.alike_stages import best_alike_split, check_alike
from resihp_ext.planner.cost import (
    ReplicaTiming, allreduce_time_s, boundary_transfers_s, equal_quotas, iteration_s, max_params_per_rank,
    quota_step, replica_timing, timing_from_factors,
)
from resihp_ext.planner.dp import assign_quotas, makespan_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import outgrown_stages
from resihp_ext.planner.moves import NoSurvivingHolder, move_time_s, state_moves
from resihp_ext.planner.plan import Plan
from resihp_ext.planner.pp import partition_layers
from resihp_ext.planner.restart import restart_layout
from resihp_ext.planner.tp import TpChoice, tp_candidates
from resihp_ext.shard_map import Transfer

NUM_EXACT_CANDIDATES = 4
MAX_COMBINATIONS = 64


@dataclass(frozen=True)
class _Candidate:
    """One way to run one replica (``replica is None``: drop it)."""

    label: str
    replica: ReplicaSpec | None
    timing: ReplicaTiming | None
    moves: tuple[Transfer, ...]  # what building this replica takes (priced shard_map transfers)
    changed: bool


def _replica_candidates(
    layout: Layout, index: int, health: Health, hw: HardwareModel, num_microbatches: int,
    uniform_tp: bool = False, stages_fixed: bool = False, may_drop: bool = True, ranks_fixed: bool = False,
    tp_exclusion: bool = False,
) -> list[_Candidate]:
    model = layout.model
    rep = layout.replicas[index]
    num_stages = rep.num_stages
    has_dead = any(r in health.dead for r in rep.ranks)
    drop = _Candidate("drop replica", None, None, (), True)
    keep = [] if has_dead else [_Candidate("keep layout", rep, replica_timing(rep, model, hw, health), (), False)]
    out: list[_Candidate] = [drop, *keep] if may_drop or not keep else list(keep)  # a dead rank's cannot be kept
    if stages_fixed:
        return out
    per_stage: list[tuple[TpChoice, ...]] = []
    for p, st in enumerate(rep.stages):
        found = tp_candidates(st.ranks, health, model, hw, stage=p, num_stages=num_stages,
                              num_microbatches=num_microbatches)
        if not found:
            return out
        per_stage.append(found)
    variants = {}
    if not ranks_fixed or tp_exclusion:  # each stage keeps ranks of its own group, maybe fewer
        variants["TP exclusion"] = [c[0] for c in per_stage]
    if not ranks_fixed:
        variants["widest TP"] = [max(c, key=lambda x: (x.tp_degree, x.score)) for c in per_stage]
    if not has_dead:
        current = []
        for p, st in enumerate(rep.stages):
            same = [c for c in per_stage[p] if c.ranks == st.ranks]
            current.append(same[0] if same else None)
        if all(current):
            variants["repartition"] = current
    seen: set[ReplicaSpec] = {rep} if not has_dead else set()
    layer_s = (hw.layer_forward_tp1_s(model),) * model.num_layers
    for label, choice in variants.items():
        if uniform_tp and len({c.tp_degree for c in choice}) > 1:
            continue  # stages of one replica at different TP degrees need activation resharding
        part = partition_layers(
            layer_s, [c.s_per_tp1_s for c in choice], last_extra=hw.output_forward_tp1_s(model),
            max_layers=[c.max_layers for c in choice], prefer=rep.layers_per_stage,
        )
        if part is None:
            continue
        stages, first = [], 0
        for num, c in zip(part.layers_per_stage, choice):
            stages.append(StageSpec(first, num, c.ranks))
            first += num
        new = ReplicaSpec(tuple(stages))
        if new in seen:
            continue
        seen.add(new)
        try:
            moves = state_moves(layout, Layout((new,), model), health.dead, hw)
        except NoSurvivingHolder:
            continue
        timing = timing_from_factors(part.layers_per_stage, [c.s_per_tp1_s for c in choice],
                                     boundary_transfers_s(new, model, hw, health), model, hw)
        out.append(_Candidate(label, new, timing, moves, True))
    return out


def _describe(old: ReplicaSpec, cand: _Candidate, health: Health) -> str:
    if cand.replica is None:
        return "dropped"
    parts = []
    for p, (a, b) in enumerate(zip(old.stages, cand.replica.stages)):
        if a.ranks != b.ranks:
            gone = [r for r in a.ranks if r not in b.ranks]
            parts.append(f"stage {p} TP {a.tp_degree}->{b.tp_degree} excluding ranks {gone}")
    if old.layers_per_stage != cand.replica.layers_per_stage:
        parts.append(f"layers {list(old.layers_per_stage)}->{list(cand.replica.layers_per_stage)}")
    return ", ".join(parts) or "layout kept"


def plan_adaptation(
    layout: Layout,
    health: Health,
    hw: HardwareModel | None = None,
    *,
    num_microbatches: int | None = None,
    horizon_iters: int = 500,
    current_quotas: tuple[int, ...] | None = None,
    uniform_tp_per_replica: bool = False,
    reshaped: Iterable[int] = (),
    stages_fixed: bool = False,
    stages_alike: bool = False,
    ranks_fixed: bool = False,
    tp_exclusion: bool = False,
    drop_to: Iterable[int] | None = None,
) -> Plan:
    """Re-plan ``layout`` for ``health``: the ResiHP policy.

    Args:
        layout: the layout running now.
        health: dead ranks, per-rank speeds, slow links.
        hw: cost constants (defaults: ``HardwareModel()``).
        num_microbatches: micro-batches per global batch (default: ``layout.model.num_microbatches``).
        horizon_iters: iterations over which an adaptation's one-time cost must pay off.
        current_quotas: quotas running now (default: equal split).
        uniform_tp_per_replica: only propose replicas whose stages share one TP degree (what an
            executor without activation resharding between stages can run).
        reshaped: replicas an earlier plan changed for a slowdown (layers moved off a slow rank);
            they are candidates for change like the affected ones, so that once that rank is fast
            again its layers can go back.
        stages_fixed: every replica keeps its ranks and layers; only the micro-batch quotas change
            (what an executor that cannot rebuild stages or drop a replica in place runs).
        stages_alike: every replica keeps its ranks per stage and TP groups, and all replicas take
            one new layer split alike, or keep theirs; quotas change as well (what an executor
            whose replicas share one model definition runs; ``alike_stages``). ``stages_fixed``
            takes precedence.
        ranks_fixed: every replica keeps its ranks per stage and TP groups; each affected one may
            take a layer split of its own, and quotas change (what an executor that builds each
            replica's model from its own split, but cannot change a TP group, runs). ``stages_fixed``
            and ``stages_alike`` take precedence.
        tp_exclusion: with ``ranks_fixed``, an affected replica may also leave slow ranks out of
            its stages' TP groups (one degree for the whole replica, each stage on ranks of its own
            group), the ranks left out leaving the layout; the new layout then lists its replicas
            in descending TP degree (an executor that numbers them in that order keeps
            ``Layout.tp_degrees_descend``).
        drop_to: with ``stages_fixed``, ``stages_alike`` or ``ranks_fixed``, the replica counts the
            executor can run: affected replicas may then be dropped whole down to one of them, their ranks left
            out (None: no replica is dropped). Without any of them replicas may always be dropped.

    Returns:
        A Plan: "keep", "adapt" (new layout, quotas, moves) or "checkpoint-restart" with a reason.

    Raises:
        ValueError: bad micro-batch counts or quotas; with ``stages_alike``, replicas of different
            shapes, a dead rank in the layout (its fail-stop is planned without the flag), or fewer
            micro-batches than replicas.
    """
    hw = hw or HardwareModel()
    model = layout.model
    num_mb = model.num_microbatches if num_microbatches is None else num_microbatches
    if num_mb < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_mb}")
    if horizon_iters < 1:
        raise ValueError(f"horizon_iters must be >= 1, got {horizon_iters}")
    quotas_now = current_quotas or equal_quotas(layout.num_replicas, num_mb)
    if len(quotas_now) != layout.num_replicas or sum(quotas_now) != num_mb:
        raise ValueError(f"current_quotas {quotas_now} must have one entry per replica and sum to {num_mb}")
    alike = stages_alike and not stages_fixed
    own_splits = ranks_fixed and not (stages_fixed or alike)
    restricted = stages_fixed or alike or own_splits
    drop_counts = frozenset(drop_to) if restricted and drop_to is not None else None
    if alike:
        check_alike(layout, health, num_mb)
    before_s = iteration_s(layout, quotas_now, health, hw)
    affected = set(layout.replicas_touching(health.affected_ranks)) | set(reshaped)
    cross_links = any(
        layout.contains(a) and layout.contains(b) and layout.replica_of(a) != layout.replica_of(b)
        for a, b in health.slow_links)
    if not affected and cross_links:
        why = "slow links between replicas only slow the gradient all-reduce; no placement avoids them"
        return Plan("keep", layout, quotas_now, (), before_s, before_s, 0.0, f"keep: {why}")
    # With no affected replica, quotas skewed for a slowdown that has since gone are still weighed
    # against the best split of the layout as it is (a device that recovered gets its work back).
    if alike:
        choice = best_alike_split(layout, health, hw, affected=affected, num_microbatches=num_mb,
                                  horizon_iters=horizon_iters, drop_to=drop_counts)
        return _conclude(layout, choice.layout, choice.quotas, choice.iteration_s, health, hw, before_s=before_s,
                         quotas_now=quotas_now, horizon_iters=horizon_iters,
                         notes=[choice.describe(layout)] if affected else [])

    # candidates: untouched replicas keep their layout (timings shared between identical ones)
    shared: dict[tuple, ReplicaTiming] = {}
    options: list[list[_Candidate]] = []
    for r, rep in enumerate(layout.replicas):
        if r in affected:
            options.append(_replica_candidates(layout, r, health, hw, num_mb, uniform_tp_per_replica, stages_fixed,
                                               may_drop=not restricted or drop_counts is not None,
                                               ranks_fixed=own_splits, tp_exclusion=own_splits and tp_exclusion))
            continue
        key = tuple((st.num_layers, st.tp_degree) for st in rep.stages)
        if key not in shared:
            shared[key] = replica_timing(rep, model, hw, health)
        options.append([_Candidate("keep layout", rep, shared[key], (), False)])

    aff = sorted(affected)
    per_replica = [sorted(options[r], key=lambda c: c.timing.per_microbatch_s if c.timing else math.inf)
                   for r in aff]
    combos = list(itertools.islice(itertools.product(*per_replica), MAX_COMBINATIONS))
    # anchors, always scored exactly: each replica's individually best choice; only quotas change
    # (replicas with a dead rank dropped); every affected replica dropped. The last two are what
    # the DP-only and drop-replica baselines do, so the plan never predicts worse than them.
    def pick(opts: list[_Candidate], label: str) -> _Candidate:
        return next((c for c in opts if c.label == label), next((c for c in opts if c.replica is None), opts[0]))

    anchors = [tuple(opts[0] for opts in per_replica),
               tuple(pick(opts, "keep layout") for opts in per_replica),
               tuple(pick(opts, "drop replica") for opts in per_replica)]
    combos.extend(anchors)

    # the gradient all-reduce depends on which replicas stay and whether a slow link still joins two
    params_of = {id(c): max_params_per_rank(c.replica, model, hw) for opts in options for c in opts if c.replica}
    links = [(layout.replica_of(a), a, layout.replica_of(b), b, v) for (a, b), v in health.slow_links.items()
             if layout.contains(a) and layout.contains(b) and layout.replica_of(a) != layout.replica_of(b)]
    rank_sets: dict[int, frozenset[int]] = {}

    def holds(cand: _Candidate, rank: int) -> bool:
        if id(cand) not in rank_sets:
            rank_sets[id(cand)] = frozenset(cand.replica.ranks)
        return rank in rank_sets[id(cand)]

    def combo_allreduce_s(chosen: list[_Candidate], kept: list[_Candidate]) -> float:
        link = min((v for ra, a, rb, b, v in links
                    if chosen[ra].replica is not None and chosen[rb].replica is not None
                    and holds(chosen[ra], a) and holds(chosen[rb], b)), default=1.0)
        return allreduce_time_s(len(kept), max(params_of[id(c)] for c in kept), hw, link)

    def assemble(combo):
        chosen = list(options[i][0] for i in range(layout.num_replicas))
        for r, cand in zip(aff, combo):
            chosen[r] = cand
        kept = [c for c in chosen if c.replica is not None]
        return chosen, kept

    ranked = []
    for combo in set(combos):
        chosen, kept = assemble(combo)
        step = max((quota_step(hw, c.replica.num_stages) for c in kept), default=1)
        # every kept replica trains at least one micro-batch (one group of them under the
        # interleaved schedule)
        if not kept or len(kept) * step > num_mb or num_mb % step:
            continue
        if drop_counts is not None and len(kept) not in drop_counts:
            continue
        if len(kept) < layout.num_replicas and hw.sharded_state_bytes_per_param and \
                outgrown_stages(layout, layout.with_replicas(c.replica for c in kept), hw):
            continue  # the kept ranks' shares of a distributed optimizer's state would not fit
        fill = [c.timing.fill_s for c in kept]
        per = [c.timing.per_microbatch_s for c in kept]
        if not any(math.isfinite(v) for v in per):
            continue
        quotas = assign_quotas(fill, per, num_mb, step=step)
        changed = any(c.changed for c in chosen)
        moves = tuple(m for c in combo for m in c.moves)
        cost_s = (hw.regroup_s + move_time_s(moves, hw)) if changed else 0.0
        est = makespan_s(fill, per, quotas) + combo_allreduce_s(chosen, kept)
        ranked.append((horizon_iters * est + cost_s, combo, chosen, kept, quotas, moves, cost_s))
    if not ranked:
        why = ("no replica can be rebuilt in place (a shard has no surviving holder in any replica, "
               "or no TP group fits in memory)")
        fallback = restart_layout(layout, health)
        if fallback is None:
            return Plan("checkpoint-restart", None, (), (), before_s, math.inf, hw.restart_s,
                        f"checkpoint-restart: {why}; too few healthy nodes remain for one replica")
        quotas = equal_quotas(fallback.num_replicas, num_mb)
        after_s = iteration_s(fallback, quotas, Health(), hw)
        return Plan("checkpoint-restart", fallback, quotas, (), before_s, after_s, hw.restart_s,
                    f"checkpoint-restart: {why}; restart with DP={fallback.num_replicas} on the nodes "
                    f"without bad devices")
    ranked.sort(key=lambda item: item[0])

    finalists = ranked[:NUM_EXACT_CANDIDATES] + [item for item in ranked[NUM_EXACT_CANDIDATES:] if item[1] in anchors]
    best = None
    for _, combo, chosen, kept, quotas, moves, cost_s in finalists:
        # exact 1F1B time per kept replica (memoised across identical replicas) plus the all-reduce
        after_s = max(c.timing.simulate_s(q) for c, q in zip(kept, quotas)) + combo_allreduce_s(chosen, kept)
        total = horizon_iters * after_s + cost_s
        if best is None or total < best[0]:
            best = (total, combo, chosen, kept, quotas, moves, cost_s, after_s)
    _, combo, chosen, kept, quotas, _, _, after_s = best
    notes = [f"replica {r}: {_describe(layout.replicas[r], c, health)}" for r, c in zip(aff, combo)]
    new_layout = layout if not any(c.changed for c in chosen) else layout.with_replicas(c.replica for c in kept)
    if own_splits and tp_exclusion and new_layout is not layout:
        # Largest TP degree first (``sorted`` keeps the order among equals), each quota with its replica.
        order = sorted(range(len(kept)), key=lambda i: -kept[i].replica.stages[0].tp_degree)
        new_layout = layout.with_replicas(kept[i].replica for i in order)
        quotas = tuple(quotas[i] for i in order)
    return _conclude(layout, new_layout, quotas, after_s, health, hw, before_s=before_s, quotas_now=quotas_now,
                     horizon_iters=horizon_iters, notes=notes)


def _conclude(layout: Layout, new_layout: Layout, quotas: tuple[int, ...], after_s: float, health: Health,
              hw: HardwareModel, *, before_s: float, quotas_now: tuple[int, ...], horizon_iters: int,
              notes: list[str]) -> Plan:
    # The Plan for the best option found (``notes``: what it does to each replica it changes, empty
    # when no replica is affected): kept unless it pays off within ``horizon_iters``.
    if not notes and tuple(quotas) == tuple(quotas_now):
        return Plan("keep", layout, quotas_now, (), before_s, before_s, 0.0, "keep: no affected replica")
    # The Plan carries, and its cost prices, the transfers to the whole new layout: exactly what
    # the executor runs (the candidates' own transfers ranked them).
    transfers = state_moves(layout, new_layout, health.dead, hw) if new_layout != layout else ()
    cost_s = hw.regroup_s + move_time_s(transfers, hw) if new_layout != layout else 0.0
    total = horizon_iters * after_s + cost_s
    moves = tuple(t for t in transfers if t.crosses)

    if horizon_iters * before_s <= total:
        return Plan("keep", layout, quotas_now, (), before_s, before_s, 0.0,
                    f"keep: best change ({after_s:.3f} s/iter after {cost_s:.1f} s of adaptation) does not pay "
                    f"off within {horizon_iters} iterations at {before_s:.3f} s/iter")
    used = set(new_layout.world_ranks)
    spares = tuple(r for r in layout.world_ranks if r not in used and r not in health.dead)
    notes = notes or ["no affected replica, layouts kept"]
    before_txt = "stalled" if not math.isfinite(before_s) else f"{before_s:.3f} s/iter"
    gain = "" if not math.isfinite(before_s) else \
        f"; pays back in {cost_s / max(before_s - after_s, 1e-12):.0f} iterations"
    reason = (f"adapt: {'; '.join(notes)}; quotas {list(quotas)}; {before_txt} -> {after_s:.3f} s/iter; "
              f"{len(moves)} moves, {sum(m.num_bytes for m in moves) / 1e9:.2f} GB, {cost_s:.1f} s{gain}")
    return Plan("adapt", new_layout, quotas, transfers, before_s, after_s, cost_s, reason, spares)


__all__ = ["plan_adaptation"]
