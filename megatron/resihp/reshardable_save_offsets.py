"""The distributed optimizer's fully reshardable save reads each parameter's state at its own offset.

megatron-core 0.19.2's ``DistributedOptimizer.sharded_param_state_fully_reshardable`` (what
``--dist-ckpt-optim-fully-reshardable`` saves) gathers each gradient buffer's optimizer state into
one flat tensor per state (``get_parameter_state_dp_zero``), its buckets laid end to end with each
bucket's end padding left out, and then cuts every parameter out of it at the offset
``param_index_map`` gives, which is the parameter's place in the padded buffer. A parameter in a
later bucket than the first is cut from too far along, by the padding of the buckets before it,
and the tail runs past the end (megatron-core logs "param range exceeds unpadded buffer" and fills
it with zeros). Buckets are padded to a multiple of 128 elements (of lcm(DP, 128)), and the word
embedding of a pipeline's first stage always has a bucket of its own, so a first stage whose other
parameters do not fill the last 128 saves the embedding's fp32 main copy and Adam's moments shifted
(TP 1, PP 2, hidden size 64, one layer on the stage: by 64 elements, one row, the last row zero).
The load cuts each parameter by its own range, so it puts the shifted state back shifted.

``install()`` hands that function, for the length of one call, each buffer's index map with the
offsets of the flat tensors it cuts (every bucket's start moved back by the padding before it);
where no bucket before a parameter is padded the map is the same, and what is saved is unchanged.
Checked against megatron-core 0.19.2, the version ``training_compat`` (imported beside it by
``gpt_pretrain``) insists on. Megatron-LM merged the same correction after that release (pull
request 5077, "Fix bugs in re-sharding DistributedOptimizer state in torch_dist checkpoint"): a
pinned megatron-core that has it makes this module unneeded.
"""

from __future__ import annotations

from typing import Callable

_undo: list[Callable[[], None]] = []


def unpadded_index_map(buffer) -> dict:
    """``buffer.param_index_map`` with each parameter's range counted without the end padding of
    the buckets before its own (the layout of the flat state tensors the save cuts)."""
    starts, total = [], 0
    for bucket in buffer.buckets:
        starts.append(total)
        total += bucket.numel_unpadded
    if total != buffer.numel_unpadded:
        raise AssertionError(f"the buckets hold {total} elements without padding, the buffer {buffer.numel_unpadded}")
    out = {}
    for param, (start, end, bucket_id) in buffer.param_index_map.items():
        padding_before = buffer.buckets[bucket_id].offset - starts[bucket_id]
        out[param] = (start - padding_before, end - padding_before, bucket_id)
    return out


def _cut_at_unpadded_offsets(save: Callable) -> Callable:
    def wrapped(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        try:
            for buffer in self.buffers:
                buffer.param_index_map = unpadded_index_map(buffer)
            return save(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    return wrapped


def install() -> None:
    """Apply the fix (idempotent)."""
    if _undo:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["sharded_param_state_fully_reshardable"]
    DistributedOptimizer.sharded_param_state_fully_reshardable = _cut_at_unpadded_offsets(original)
    _undo.append(lambda: setattr(DistributedOptimizer, "sharded_param_state_fully_reshardable", original))


def uninstall() -> None:
    """Undo ``install()``."""
    while _undo:
        _undo.pop()()
