"""Runs a plan's state transfers: units of weights, fp32 main copies and Adam moments between ranks.

Responsible for the "move state" step of a reconfiguration: every rank passes the same list of
``resihp_ext.shard_map.Transfer`` (the Plan's ``transfers``), and each copies locally what it
already held and sends or receives the rest point-to-point, in the same world
(``apply_transfers``) or staged before a re-form while leavers are still members
(``stage_transfers`` then ``unstage_transfers``). Source and destination address a parameter by
its unsharded name (``layer_sync.param_slots``), so stages of different layer splits or TP
degrees meet.

It must never create or destroy process groups and never decides who sends or receives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _megatron_optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def _torch_optimizers(optimizer) -> list:
    return [o.optimizer for o in _megatron_optimizers(optimizer)]


def _main_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The optimizer's fp32 main copy of a bf16/fp16 model parameter (None in fp32 training).

    Under --bf16/--fp16 megatron-core's optimizer steps fp32 copies and writes them back rounded,
    so the copy, not the model parameter, is the state: rebuilt from a rounded parameter it would
    lose every update smaller than the rounding, and Adam's moments are keyed by it.
    """
    return getattr(param, "main_param", None)


def _adam_state(optimizer, param: torch.nn.Parameter, create_like: dict | None) -> dict | None:
    key = _main_param(param)
    key = param if key is None else key
    for opt in _torch_optimizers(optimizer):
        if any(key is p for group in opt.param_groups for p in group["params"]):
            if key not in opt.state and create_like is not None:
                opt.state[key] = {k: (v.clone() if k == "step" else torch.zeros_like(key))
                                  for k, v in create_like.items()}
            return opt.state.get(key)
    return None


def _adam_template(objects, slots) -> dict | None:
    """Any Adam state of this rank: every rank has stepped equally often, so it shapes new states."""
    return next((s for slot in slots for s in [_adam_state(objects.optimizer, slot.param, None)] if s), None)


def _template_of(old_objects, old_slots, adam_template: dict | None) -> dict | None:
    """What shapes new Adam states: this rank's own, or on a rank that joins holding nothing
    (``old_objects`` None), ``adam_template`` (``adam_template_of`` on a working rank)."""
    if old_objects is not None:
        return _adam_template(old_objects, old_slots)
    return {k: torch.tensor(v, dtype=torch.float32) if k == "step" else None
            for k, v in (adam_template or {}).items()} or None


def _flat_dtype(views: list[torch.Tensor]) -> torch.dtype:
    """The dtype one buffer of ``views`` travels in: ``torch.cat``'s, which holds each exactly
    (bf16 weights beside their fp32 main copies travel as fp32)."""
    dtype = views[0].dtype
    for view in views[1:]:
        dtype = torch.promote_types(dtype, view.dtype)
    return dtype


def _unpack(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    offset = 0
    for view in views:
        view.copy_(flat[offset:offset + view.numel()].view_as(view))
        offset += view.numel()


def _unit_views(slots, optimizer, holding, t, template, whole: dict | None = None) -> list[torch.Tensor]:
    """Canonical tensor list of one transfer on one side: per slot (by name) weight, its fp32 main
    copy under --bf16/--fp16, then Adam moments. ``whole``: model parameter -> its whole optimizer
    state (``optimizer_parts.whole_states``: the distributed optimizer's, gathered over its
    position), read or written instead of the optimizer's own."""
    from resihp_ext.shard_map import unit_range

    from megatron.resihp.layer_sync import unit_view

    out = []
    for slot in slots:
        if slot.item != t.item or (slot.partition_dim is None) != t.replicated:
            continue
        if whole is not None:
            tensors = [slot.param.data, *(row.view_as(slot.param) for row in whole[slot.param])]
        else:
            state = _adam_state(optimizer, slot.param, template) if optimizer is not None else None
            main = _main_param(slot.param) if optimizer is not None else None
            tensors = ([slot.param.data] + ([main.data] if main is not None else [])
                       + ([state["exp_avg"], state["exp_avg_sq"]] if state else []))
        for tensor in tensors:
            if t.replicated:
                out.append(tensor)
            else:
                held = unit_range(holding, t.grid)
                out.append(unit_view(tensor, slot.partition_dim, held.start, t.unit, len(held)))
    return out


@torch.no_grad()
def stage_transfers(transfers, old_layout, rank: int, old_objects, peer_rank, ran: list | None = None,
                    whole: dict | None = None) -> dict:
    """Phase 1 of a move that changes the world: send what others need, receive into flat buffers.

    Runs in a world holding every source and destination (spares included); ``peer_rank`` maps a
    layout rank to its rank in that world. Sizes travel first, so receivers need no model yet
    (a standby taken back holds nothing: ``old_objects`` None, it only receives).
    ``ran``, when given, collects every transfer between two ranks this rank sent or received.
    ``whole``: under the distributed optimizer, the old model's whole optimizer states, which the
    sent units are read from (``apply_transfers``).

    Returns:
        ``{transfer index: flat tensor}`` for what this rank received (local copies excluded).
    """
    from resihp_ext.shard_map import holders

    from megatron.resihp.layer_sync import objects_slots

    old_slots = objects_slots(old_objects) if old_objects is not None else []
    old_holders = holders(old_layout)
    template = _adam_template(old_objects, old_slots) if old_objects is not None else None
    payloads, sizes, incoming = {}, [], {}
    for i, t in enumerate(transfers):
        if ran is not None and t.src != t.dst and rank in (t.src, t.dst):
            ran.append(t)
        if t.src == rank and t.dst != rank:
            holding = next(h for h in old_holders[t.item] if h.rank == rank)
            views = _unit_views(old_slots, old_objects.optimizer, holding, t, template, whole)
            # An item can have no tensor of a kind (with PP 1 and tied embeddings, "last" has no
            # TP-split one): its size goes out as 0 and nothing else is sent.
            # Always fp32 on the wire: the receiver sizes its buffer before it has a model.
            flat = torch.cat([v.reshape(-1) for v in views]).float() if views else torch.zeros(0)
            payloads[i] = flat
            sizes.append(dist.P2POp(dist.isend, torch.tensor([flat.numel()], dtype=torch.int64), peer_rank(t.dst)))
        elif t.dst == rank and t.src != rank:
            incoming[i] = torch.zeros(1, dtype=torch.int64)
            sizes.append(dist.P2POp(dist.irecv, incoming[i], peer_rank(t.src)))
    for work in dist.batch_isend_irecv(sizes) if sizes else []:
        work.wait()
    data, received = [], {}
    for i, t in enumerate(transfers):
        if i in payloads and payloads[i].numel():
            data.append(dist.P2POp(dist.isend, payloads[i], peer_rank(t.dst)))
        elif i in incoming:
            received[i] = torch.empty(int(incoming[i]), dtype=torch.float32)
            if received[i].numel():
                data.append(dist.P2POp(dist.irecv, received[i], peer_rank(t.src)))
    for work in dist.batch_isend_irecv(data) if data else []:
        work.wait()
    return received


@torch.no_grad()
def unstage_transfers(transfers, old_layout, new_layout, rank: int, old_objects, new_objects, received,
                      adam_template: dict | None = None, whole: tuple[dict, dict] | None = None) -> None:
    """Phase 2: fill the rebuilt model and optimizer from local state and the staged buffers
    (``old_objects`` None on a rank that held nothing: ``adam_template`` shapes its Adam states;
    ``whole``: the old and the new model's whole optimizer states, as for ``apply_transfers``)."""
    from resihp_ext.shard_map import holders

    from megatron.resihp.layer_sync import objects_slots

    old_slots = objects_slots(old_objects) if old_objects is not None else []
    new_slots = objects_slots(new_objects)
    old_holders, new_holders = holders(old_layout), holders(new_layout)
    template = _template_of(old_objects, old_slots, adam_template)
    for i, t in enumerate(transfers):
        if t.dst != rank:
            continue
        target = _unit_views(new_slots, new_objects.optimizer, next(h for h in new_holders[t.item] if h.rank == rank),
                             t, template, whole[1] if whole else None)
        if t.src == rank:
            source = _unit_views(old_slots, old_objects.optimizer,
                                 next(h for h in old_holders[t.item] if h.rank == rank), t, template,
                                 whole[0] if whole else None)
            for a, b in zip(source, target):
                b.copy_(a)
            continue
        _unpack(received[i], target)


def _grad_scalers(optimizer) -> list:
    return [o.grad_scaler for o in _megatron_optimizers(optimizer) if getattr(o, "grad_scaler", None) is not None]


def loss_scale_state(optimizer) -> list[dict]:
    """fp16's loss-scaler state, JSON-ready (empty without one). A rebuilt optimizer starts its
    scaler at --initial-loss-scale again; carried over, training keeps the scale it had found."""
    return [{k: float(v) if torch.is_tensor(v) else v for k, v in scaler.state_dict().items()}
            for scaler in _grad_scalers(optimizer)]


def load_loss_scale_state(optimizer, states: list[dict]) -> None:
    for scaler, state in zip(_grad_scalers(optimizer), states):
        if state:
            scaler.load_state_dict({k: torch.tensor([v], dtype=torch.float32) if k == "scale" else v
                                    for k, v in state.items()})


def carry_schedule(old_objects, new_objects) -> None:
    """What a rebuilt optimizer and LR scheduler must keep besides the moved tensors: the
    scheduler's step and fp16's loss scale."""
    new_objects.scheduler.load_state_dict(old_objects.scheduler.state_dict())
    load_loss_scale_state(new_objects.optimizer, loss_scale_state(old_objects.optimizer))


def adam_template_of(objects) -> dict:
    """``_adam_template`` JSON-ready: its keys and step count (empty before the first step)."""
    from megatron.resihp.layer_sync import objects_slots

    template = _adam_template(objects, objects_slots(objects)) or {}
    return {k: (float(v) if k == "step" else None) for k, v in template.items()}


@torch.no_grad()
def apply_transfers(transfers, old_layout, new_layout, rank: int, old_objects, new_objects,
                    adam_template: dict | None = None, ran: list | None = None,
                    whole: tuple[dict, dict] | None = None) -> int:
    """Fill the rebuilt model and optimizer of this rank from wherever each unit lives now.

    Every rank passes the same ``transfers`` (the plan's: ``resihp_ext.shard_map.transfers``); each
    unit of every tensor of an item (weights, Adam moments) is copied locally when this rank already
    held it, or sent point-to-point over the default group otherwise. All sends and receives are posted
    at once, so no ordering between pairs can deadlock.

    A rank that joins the world holds nothing (``old_objects`` None); ``adam_template``
    (``adam_template_of`` on a working rank) then shapes its Adam states and gives their step.
    ``ran``, when given, collects every transfer between two ranks this rank sent or received.
    ``whole``: under the distributed optimizer, the old and the new model's whole optimizer states
    (``optimizer_parts.whole_states``), which the moved units are read from and written to.

    Returns:
        Bytes this rank sent or received.
    """
    from resihp_ext.shard_map import holders

    from megatron.resihp.layer_sync import objects_slots

    old_slots = objects_slots(old_objects) if old_objects is not None else []
    new_slots = objects_slots(new_objects)
    old_holders, new_holders = holders(old_layout), holders(new_layout)
    template = _template_of(old_objects, old_slots, adam_template)

    ops, receives, sent = [], [], 0  # sent: bytes through this rank, both directions
    for t in transfers:
        if rank not in (t.src, t.dst):
            continue
        if ran is not None and t.src != t.dst:
            ran.append(t)
        if t.src == rank:
            payload = _unit_views(old_slots, old_objects.optimizer,
                                  next(h for h in old_holders[t.item] if h.rank == rank), t, template,
                                  whole[0] if whole else None)
        if t.dst == rank:
            target = _unit_views(new_slots, new_objects.optimizer,
                                 next(h for h in new_holders[t.item] if h.rank == rank), t, template,
                                 whole[1] if whole else None)
        if t.src == rank and t.dst == rank:
            for a, b in zip(payload, target):
                b.copy_(a)
        elif not (payload if t.src == rank else target):
            continue  # the item has no tensor of this kind (with PP 1 and tied embeddings, "last")
        elif t.src == rank:
            flat = torch.cat([v.reshape(-1) for v in payload])
            ops.append(dist.P2POp(dist.isend, flat, t.dst))
            sent += flat.numel() * flat.element_size()
        else:
            flat = torch.empty(sum(v.numel() for v in target), dtype=_flat_dtype(target))
            ops.append(dist.P2POp(dist.irecv, flat, t.src))
            receives.append((flat, target))
            sent += flat.numel() * flat.element_size()
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for flat, target in receives:
        _unpack(flat, target)
    return sent
