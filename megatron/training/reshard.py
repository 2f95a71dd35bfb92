"""Moves one stage's state onto ranks rebuilt into that stage, from a surviving replica.

Responsible for the "move state" step of a reconfiguration after a fail-stop: a rank rebuilt into
(stage, TP shard) receives the parameters (and optimizer-state tensors) of the surviving rank
that holds the same (stage, TP shard) in another replica, by broadcast over a group containing
the source and the destinations. Source and destinations must have built the same modules (same
names, shapes, dtypes) on the new groups before calling.

It must never create or destroy process groups (the caller passes one, usually built by
``parallel_state_patch.build_groups``) and never decides who sends or receives.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def _state_tensors(module: torch.nn.Module, optimizer_states: Iterable[dict] = ()) -> list[torch.Tensor]:
    # Named order, then each optimizer state's keys sorted: identical on every rank of the group.
    tensors = [t for _, t in sorted(module.state_dict(keep_vars=True).items()) if isinstance(t, torch.Tensor)]
    for state in optimizer_states:
        tensors += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return tensors


@torch.no_grad()
def copy_stage_state_from_replica(
    module: torch.nn.Module,
    src: int,
    group: dist.ProcessGroup,
    optimizer_states: Iterable[dict] = (),
) -> int:
    """Overwrite ``module``'s parameters and buffers (and optimizer-state tensors) with ``src``'s.

    Every rank of ``group`` calls this; on ``src`` the tensors are sent, elsewhere overwritten.

    Args:
        module: this rank's stage module, built alike on every rank of ``group``.
        src: global rank of the surviving holder of the same (stage, TP shard).
        group: a group containing ``src`` and every destination.
        optimizer_states: per-parameter optimizer state dicts (e.g. ``exp_avg``, ``exp_avg_sq``),
            in parameter order, already allocated with the right shapes on destinations.

    Returns:
        Number of bytes this rank sent or received.
    """
    tensors = _state_tensors(module, list(optimizer_states))
    # One flat buffer per dtype: a broadcast per tensor costs a round trip each.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    total = 0
    for dtype in sorted(by_dtype, key=str):
        group_tensors = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        total += flat.numel() * flat.element_size()
        if dist.get_rank() != src:
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return total


__all__ = ["copy_stage_state_from_replica"]
