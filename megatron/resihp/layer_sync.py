"""Gradient synchronisation derived from a Layout, for replicas that differ.

Responsible for replacing megatron-core's per-replica DP all-reduce when replicas are not alike
(different layer splits or TP degrees): every parameter is addressed by its item and TP units
(``resihp_ext.shard_map``), and its gradient is summed over exactly the ranks that hold the same
units, whichever stage or TP degree they run it at. It also owns the parameter addressing the
resharder uses. Its groups come from the group builder (``parallel_state_patch.build_groups``, over
``shard_map.sync_rank_sets``); this module never creates a group and never decides a layout.

Per-token loss stays exact: the token count is summed once per replica over the whole job and
every gradient is divided by it, as megatron-core's own finalize does within one DP group. Without
a token count (Megatron-LM's loop without ``--calculate-per-token-loss``: each replica's loss is
its micro-batches' mean) the sums are divided by the replica count, the average megatron-core's
DDP takes over its DP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads
from megatron.core.utils import unwrap_model

from resihp_ext.layout import Layout
from resihp_ext.shard_map import finest_degree, holders, replicated_sync_set, unit_range


@dataclass(frozen=True)
class ParamSlot:
    """Where one local parameter sits in the unsharded model."""

    name: str  # global name (layer indices as in the unsharded model)
    item: tuple
    partition_dim: int | None  # None: replicated across TP ranks
    param: torch.nn.Parameter


def _item_of(global_name: str, layer: int | None) -> tuple:
    if layer is not None:
        return ("layer", layer)
    if global_name.startswith("embedding."):
        return ("first",)
    return ("last",)  # decoder.final_layernorm.*, output_layer.*


def param_slots(gpt_model: torch.nn.Module) -> list[ParamSlot]:
    """Every local parameter with its global name and item, sorted by global name. Under
    --bf16/--fp16 Megatron's own builder wraps the model (``Float16Module``); names are the model's.
    A layer is named by its number in the whole model (megatron-core's, also under the interleaved
    schedule, whose chunks hold layers apart), as the Layout's items name it."""
    gpt_model = unwrap_model(gpt_model)
    layers = getattr(getattr(gpt_model, "decoder", None), "layers", [])
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    slots = []
    for name, param in gpt_model.named_parameters():
        parts = name.split(".")
        layer = None
        if "layers" in parts:
            k = parts.index("layers") + 1
            layer = local_to_global[int(parts[k])]
            parts[k] = str(layer)
        global_name = ".".join(parts)
        partition_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        slots.append(ParamSlot(global_name, _item_of(global_name, layer), partition_dim, param))
    return sorted(slots, key=lambda s: s.name)


def chunks_slots(chunks) -> list[ParamSlot]:
    """``param_slots`` of every model chunk of a rank (the interleaved schedule's several, each
    wrapped in DDP), sorted by global name: one order on every rank."""
    return sorted((s for chunk in chunks for s in param_slots(chunk.module)), key=lambda s: s.name)


def objects_slots(objects) -> list[ParamSlot]:
    """``chunks_slots`` of a rank's ``TrainingObjects``."""
    return chunks_slots(objects.chunks)


def unit_view(tensor: torch.Tensor, partition_dim: int, first_unit: int, unit: int, units_held: int) -> torch.Tensor:
    """The slice of a local TP shard that is global unit ``unit`` (the shard starts at ``first_unit``)."""
    return tensor.chunk(units_held, dim=partition_dim)[unit - first_unit]


class LayoutGradSync:
    """The ``finalize_model_grads_func`` for a Layout; build it on every rank after install.

    Args:
        layout: the installed layout.
        rank: this rank.
        groups: the installed ``ParallelGroups``: its ``sync_groups`` (one group per rank set of
            ``resihp_ext.shard_map.sync_rank_sets`` this rank belongs to) and this rank's pipeline
            and embedding groups (the group builder creates them all; this class never creates or
            destroys a group, nor looks one up).
    """

    def __init__(self, layout: Layout, rank: int, groups):
        self.layout = layout
        self.rank = rank
        self.holders = holders(layout)
        self.groups = dict(groups.sync_groups)
        self.embedding_group, self.pp_group = groups.embedding_group, groups.pp_group
        replica, stage = layout.stage_of(rank)
        # Counts the replica's tokens once: its last stage, TP rank 0.
        self.counts_tokens = (stage == len(layout.replicas[replica].stages) - 1 and layout.tp_rank_of(rank) == 0)
        mine = [h for hs in self.holders.values() for h in hs if h.rank == rank]
        self.me = mine[0] if mine else None

    def _buckets(self, slots: list[ParamSlot], config) -> dict[tuple[int, ...], list[tuple[torch.Tensor, float]]]:
        """Gradient views to sum per rank set, each with the factor this rank contributes it at."""
        buckets: dict[tuple[int, ...], list[tuple[torch.Tensor, float]]] = {}
        for slot in slots:
            grad = slot.param.main_grad
            hs = self.holders[slot.item]
            mine = next(h for h in hs if h.rank == self.rank)
            if slot.partition_dim is None:
                ranks = replicated_sync_set(self.layout, slot.item)
                # A replicated gradient is whole on every TP rank of a stage (count each replica once),
                # or, where megatron-core sums it over the TP group, each rank's part of it.
                factor = 1.0 if tp_partial(slot, config) else 1.0 / mine.tp_degree
                buckets.setdefault(ranks, []).append((grad, factor))
                continue
            grid = finest_degree(hs)
            held = unit_range(mine, grid)
            for unit in held:
                ranks = tuple(sorted(h.rank for h in hs if unit in unit_range(h, grid)))
                view = unit_view(grad, slot.partition_dim, held.start, unit, len(held))
                buckets.setdefault(ranks, []).append((view, 1.0))
        return buckets

    def __call__(self, model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        config = model[0].config
        # Tied word embedding: first and last stage of this replica share one gradient.
        _allreduce_word_embedding_grads(model, config, self.embedding_group, self.pp_group)
        slots = chunks_slots(model)
        buckets = self._buckets(slots, config)
        for ranks in sorted(buckets):  # one canonical order on every rank: no cross-group deadlock
            group = self.groups.get(ranks)
            if group is None:
                continue  # held by this rank alone: nothing to sum
            views = buckets[ranks]
            flat = torch.cat([v.reshape(-1) * f for v, f in views])
            dist.all_reduce(flat, group=group)
            offset = 0
            for view, _ in views:
                view.copy_(flat[offset:offset + view.numel()].view_as(view))
                offset += view.numel()
        if num_tokens is not None:
            total = total_tokens(num_tokens, self.counts_tokens)
            for slot in slots:
                slot.param.main_grad.div_(total)
        elif len(self.layout.replicas) > 1:
            for slot in slots:
                slot.param.main_grad.mul_(1.0 / len(self.layout.replicas))


def tp_partial(slot: ParamSlot, config) -> bool:
    """Whether each TP rank holds only its part of this replicated parameter's gradient, which
    megatron-core's finalize sums over the TP group: the norms under sequence parallelism (each rank
    saw its part of the sequence) and the query/key norms (each rank saw its heads)."""
    if getattr(slot.param, "average_gradients_across_tp_domain", False):
        return False
    if getattr(config, "sequence_parallel", False) and getattr(slot.param, "sequence_parallel", False):
        return True
    return bool(getattr(config, "qk_layernorm", False)) and ("q_layernorm" in slot.name or "k_layernorm" in slot.name)


def total_tokens(num_tokens: torch.Tensor, counts: bool) -> torch.Tensor:
    """Tokens of the whole global batch: each replica's last stage, TP rank 0 (``counts``), contributes once."""
    mine = num_tokens.to(torch.float64).clone()
    if not counts:
        mine.zero_()
    dist.all_reduce(mine)
    return mine.to(torch.float32).clamp(min=1.0)
