"""One layer split for every replica: fail-slow re-plans for replicas that share one model definition.

Responsible for the planner's search when every data-parallel replica must keep one shape. An
executor that runs Megatron-LM's own training loop builds every replica from one model
definition, so all replicas hold the same layers per stage, and every stage keeps its ranks and
its TP group, before and after a re-plan. The only changes weighed here are one new layer split,
applied to every replica alike, and the micro-batch quotas.

Candidate splits: the current one (quotas alone, always weighed, so the result never predicts
worse than quotas alone), the split ``partition_layers`` proposes for each affected replica's
stage speeds, and every split of the layers over the stages when there are few. Each is ranked
with the affine pipeline model and DP quotas over all replicas under it; the best few, the
current split and the proposed ones are scored with the exact 1F1B simulator, a changed split
paying the regroup and its state transfers once against ``horizon_iters``.

Dropping whole replicas keeps every replica alike too: when the executor can run fewer replicas
(``drop_to``: the replica counts it can split the batch over), the affected replicas are also
weighed out of the layout, each alone and all together, with every split of the replicas left;
their ranks then stand by. It never excludes a TP device or leaves part of a replica out, and it
plans no fail-stop (a layout with a dead rank is refused). Turning its choice into a Plan (the
pay-off rule, the reason) is ``joint.plan_adaptation``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec, replica_shape
from resihp_ext.planner.cost import (ReplicaTiming, allreduce_s, boundary_transfers_s, layer_costs, quota_step,
                                    timing_from_factors)
from resihp_ext.planner.dp import assign_quotas, makespan_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import outgrown_stages
from resihp_ext.planner.moves import move_time_s, state_moves
from resihp_ext.planner.pp import partition_layers
from resihp_ext.planner.tp import TpChoice, group_time_factor, tp_candidates

# Every split is tried when there are at most this many (8 layers on 4 stages: 35; 32 on 4: 4,495).
MAX_ALL_SPLITS = 512
# Splits scored exactly besides the current one and the proposed ones.
NUM_EXACT_SPLITS = 6

Split = tuple[int, ...]


@dataclass(frozen=True)
class AlikeChoice:
    """The best way to run every replica under one split.

    Attributes:
        layout: the layout with that split applied to every replica (the running one if unchanged).
        quotas: micro-batches per replica.
        iteration_s: exact predicted seconds per iteration (1F1B plus the gradient all-reduce).
        dropped: replicas of the running layout left out (their ranks stand by), ascending.
    """

    layout: Layout
    quotas: tuple[int, ...]
    iteration_s: float
    dropped: tuple[int, ...] = ()

    def describe(self, old: Layout) -> str:
        before, after = old.replicas[0].layers_per_stage, self.layout.replicas[0].layers_per_stage
        kept = "every replica" if not self.dropped else \
            f"replica{'s' if len(self.dropped) > 1 else ''} {list(self.dropped)} dropped; the rest"
        return f"{kept}: layout kept" if before == after else f"{kept}: layers {list(before)}->{list(after)}"


def check_alike(layout: Layout, health: Health, num_microbatches: int) -> None:
    """Raise ValueError when ``layout`` and ``health`` are not for a one-shape re-plan.

    Raises:
        ValueError: the replicas differ in shape, a rank of the layout is dead (fail-stop recovery
            plans for it), or there are fewer micro-batches than replicas (every replica is kept and
            trains at least one).
    """
    if not layout.replicas_alike():
        shapes = sorted({replica_shape(r) for r in layout.replicas})
        raise ValueError(f"stages_alike needs replicas of one shape, got (layers, TP degree) per stage {shapes}; "
                         "plan without stages_alike, or re-form the replicas alike first")
    dead = sorted(r for r in health.dead if layout.contains(r))
    if dead:
        raise ValueError(f"stages_alike plans fail-slow changes only, but ranks {dead} are dead; plan their "
                         "fail-stop recovery instead (plan_adaptation without stages_alike, or a restart)")
    if layout.num_replicas > num_microbatches:
        raise ValueError(f"stages_alike keeps all {layout.num_replicas} replicas, each training at least one "
                         f"micro-batch, but the batch has {num_microbatches}; raise the global batch size")


def replica_with_split(rep: ReplicaSpec, split: Split) -> ReplicaSpec:
    """``rep`` holding ``split`` layers per stage, each stage keeping its ranks."""
    firsts = itertools.accumulate(split[:-1], initial=0)
    return ReplicaSpec(tuple(StageSpec(first, num, st.ranks) for first, num, st in zip(firsts, split, rep.stages)))


def with_split(layout: Layout, split: Split) -> Layout:
    """``layout`` with every replica holding ``split`` layers per stage, each stage keeping its ranks."""
    return layout.with_replicas(replica_with_split(rep, split) for rep in layout.replicas)


def _current_groups(rep: ReplicaSpec, health: Health, layout: Layout, hw: HardwareModel,
                    num_microbatches: int) -> list[TpChoice] | None:
    # Each stage's TP group as it is (its speed and memory cap); None when one fits no layer. The
    # replicas are alike, so each stage's data-parallel group is one rank of every replica.
    out = []
    for p, st in enumerate(rep.stages):
        found = tp_candidates(st.ranks, health, layout.model, hw, stage=p, num_stages=rep.num_stages,
                              num_microbatches=num_microbatches, dp_degree=layout.num_replicas)
        same = [c for c in found if c.ranks == st.ranks]
        if not same:
            return None
        out.append(same[0])
    return out


def candidate_splits(layout: Layout, health: Health, hw: HardwareModel, affected: Iterable[int],
                     num_microbatches: int) -> tuple[tuple[Split, ...], tuple[Split, ...]]:
    """Splits worth weighing for every replica.

    Args:
        layout: the running layout (replicas alike).
        health: per-rank speeds and slow links.
        hw: cost and memory constants.
        affected: replicas a split may be proposed for (none: only the current split).
        num_microbatches: micro-batches per global batch (bounds in-flight activations).

    Returns:
        ``(anchors, others)``: the current split followed by each affected replica's best split for
        its stage speeds (``partition_layers``); then, when there are at most ``MAX_ALL_SPLITS``,
        every other split that fits in memory on every replica. All distinct.
    """
    model = layout.model
    current = layout.replicas[0].layers_per_stage
    affected = sorted(set(affected))
    if not affected:
        return (current,), ()  # a layout no failure touched keeps the split it runs
    groups = [_current_groups(rep, health, layout, hw, num_microbatches) for rep in layout.replicas]
    if any(g is None for g in groups):
        return (current,), ()
    # One split serves every replica, so a stage holds no more layers than its tightest replica fits.
    caps = [min(g[p].max_layers for g in groups) for p in range(len(current))]
    anchors = [current]
    for r in affected:
        part = partition_layers(layer_costs(model, hw), [c.s_per_tp1_s for c in groups[r]],
                                last_extra=hw.output_forward_tp1_s(model), max_layers=caps, prefer=current)
        if part is not None:
            anchors.append(part.layers_per_stage)
    anchors = list(dict.fromkeys(anchors))
    others = []
    num_layers, num_stages = model.num_layers, len(current)
    if math.comb(num_layers - 1, num_stages - 1) <= MAX_ALL_SPLITS:
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            split = tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_layers)))
            if split not in anchors and all(n <= c for n, c in zip(split, caps)):
                others.append(split)
    return tuple(anchors), tuple(others)


def best_alike_split(layout: Layout, health: Health, hw: HardwareModel, *, affected: Iterable[int],
                     num_microbatches: int, horizon_iters: int,
                     drop_to: Collection[int] | None = None) -> AlikeChoice:
    """The split (with its quotas) that runs ``horizon_iters`` iterations soonest, a change paying
    ``hw.regroup_s`` plus its state transfers once.

    Args:
        layout: the running layout; ``check_alike`` must accept it.
        health: per-rank speeds and slow links (no dead rank of the layout).
        hw: cost constants.
        affected: replicas touched by the slowdown (or reshaped earlier).
        num_microbatches: micro-batches per global batch.
        horizon_iters: iterations over which a change must pay off.
        drop_to: the replica counts the executor can run; affected replicas may then be dropped
            down to one of them (None: no replica is dropped).

    Returns:
        The best ``AlikeChoice``; the current split with speed-weighted quotas when nothing beats it.
    """
    affected = sorted(set(affected))
    best = _best_split(layout, layout, health, hw, affected, num_microbatches, horizon_iters, regroup=False)
    if not drop_to:
        return best[1]
    for dropped in dict.fromkeys([*((r,) for r in affected), tuple(affected)]):
        kept = [r for r in range(layout.num_replicas) if r not in dropped]
        if not kept or len(kept) not in drop_to or len(kept) > num_microbatches:
            continue
        reduced = layout.with_replicas(layout.replicas[r] for r in kept)
        if outgrown_stages(layout, reduced, hw):  # the kept ranks' optimizer shares would not fit
            continue
        still = [i for i, r in enumerate(kept) if r in affected]
        total, choice = _best_split(layout, reduced, health, hw, still, num_microbatches, horizon_iters, regroup=True)
        if total < best[0]:
            best = (total, dataclasses.replace(choice, dropped=dropped))
    return best[1]


def _best_split(running: Layout, layout: Layout, health: Health, hw: HardwareModel, affected: Sequence[int],
                num_microbatches: int, horizon_iters: int, *, regroup: bool) -> tuple[float, AlikeChoice]:
    # The best split of ``layout``'s replicas (``running``'s, or some of them when ``regroup``:
    # a change whatever the split), with its seconds over the horizon, the change's cost included.
    model = layout.model
    current = layout.replicas[0].layers_per_stage
    anchors, others = candidate_splits(layout, health, hw, affected, num_microbatches)
    # A stage's speed and its boundaries' transfers depend on its ranks alone, not on its layers:
    # replicas equal in both time alike under every split, so each kind is timed once per split.
    kinds: dict[tuple, list[int]] = {}
    for r, rep in enumerate(layout.replicas):
        key = (tuple(group_time_factor(st.ranks, health, hw) for st in rep.stages),
               boundary_transfers_s(rep, model, hw, health))
        kinds.setdefault(key, []).append(r)

    def timings(split: Split) -> list[ReplicaTiming]:
        out: list[ReplicaTiming | None] = [None] * layout.num_replicas
        for (factors, transfers), members in kinds.items():
            timing = timing_from_factors(split, factors, transfers, model, hw)
            for r in members:
                out[r] = timing
        return out

    # Under the interleaved schedule a replica runs whole groups of micro-batches only.
    step = max(quota_step(hw, rep.num_stages) for rep in layout.replicas)
    ranked = []
    for split in (*anchors, *others):
        times = timings(split)
        fill, per = [t.fill_s for t in times], [t.per_microbatch_s for t in times]
        quotas = assign_quotas(fill, per, num_microbatches, step=step)
        new = layout if split == current else with_split(layout, split)
        ranked.append((makespan_s(fill, per, quotas) + allreduce_s(new, hw, health), split, new, times, quotas))
    ranked.sort(key=lambda item: item[0])
    # The affine ranking leaves the transfers out (pricing every split's would cost more than the
    # search); the current split and the proposed ones are always scored with them.
    finalists = ranked[:NUM_EXACT_SPLITS] + [item for item in ranked[NUM_EXACT_SPLITS:] if item[1] in anchors]
    best = None
    for _, split, new, times, quotas in finalists:
        after_s = max(t.simulate_s(q) for t, q in zip(times, quotas)) + allreduce_s(new, hw, health)
        changed = regroup or split != current
        cost_s = hw.regroup_s + move_time_s(state_moves(running, new, health.dead, hw), hw) if changed else 0.0
        total = horizon_iters * after_s + cost_s
        if best is None or total < best[0]:
            best = (total, AlikeChoice(new, quotas, after_s))
    return best


__all__ = ["AlikeChoice", "best_alike_split", "candidate_splits", "check_alike", "replica_with_split", "with_split"]
