"""What the planner's memory model reads from a Megatron job: its device's memory and its flags.

Responsible for ``job_memory_facts``: the ``HardwareModel`` fields every plan of this job is sized
with (fail-slow layer moves, a stage group going on at a smaller TP degree, every replica
re-formed), from ``--resihp-device-memory-gb`` or the CUDA device's total memory, the weights'
precision, where gradients accumulate, the distributed optimizer, sequence parallelism, the
attention kernel and recomputation; and ``memory_line``, the start line that shows them.
"""

from __future__ import annotations

import argparse

import torch

from resihp_ext.layout import Layout
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.memory import largest_stage_bytes, megatron_state_bytes


def device_memory_bytes(gib: float | None) -> float:
    """``gib`` GiB when given; else the CUDA device's total memory, or the reference device's
    without CUDA."""
    if gib is not None:
        return gib * 2**30
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return HardwareModel.device_memory_bytes


def _keeps_attention_scores(args: argparse.Namespace) -> bool:
    # Selective recomputation of the core attention recomputes its scores; flash and fused kernels
    # (Transformer Engine's, chosen by default on a GPU) never store them; megatron-core's local
    # attention and the unfused backends keep them for the backward.
    if args.recompute_granularity == "selective" and "core_attn" in (getattr(args, "recompute_modules", None)
                                                                     or ["core_attn"]):
        return False
    backend = getattr(getattr(args, "attention_backend", None), "name", "auto")
    return args.transformer_impl == "local" or backend in ("unfused", "local")


def job_memory_facts(args: argparse.Namespace, device_memory_gb: float | None) -> dict:
    """``HardwareModel`` fields for this job's memory (``resihp_ext.planner.memory``).

    Full recomputation counts as a layer keeping only its input under the ``uniform`` method (the
    working set of the group being recomputed is left out, as workspaces are); under ``block``
    some layers keep everything, which the model then counts for every layer (an overestimate).
    """
    half = bool(args.bf16 or args.fp16)
    facts = megatron_state_bytes(half_precision=half,
                                 grads_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", True)),
                                 distributed_optimizer=bool(args.use_distributed_optimizer))
    return dict(facts, device_memory_bytes=device_memory_bytes(device_memory_gb),
                activation_bytes_per_value=2.0 if half else 4.0,
                sequence_parallel=bool(args.sequence_parallel),
                keeps_attention_scores=_keeps_attention_scores(args),
                recomputes_layers=args.recompute_granularity == "full" and args.recompute_method == "uniform")


def memory_line(hw: HardwareModel, launch: Layout) -> str:
    """The start line: the device memory plans are sized with, the estimate of the launch's largest
    stage, and what follows where that estimate is above the device."""
    device, need = hw.device_memory_bytes / 2**30, largest_stage_bytes(launch, hw) / 2**30
    line = (f" resihp: plans sized for {device:.3g} GiB a device (--resihp-device-memory-gb); the launch's "
            f"largest stage is estimated at {need:.3g} GiB")
    if need > device:
        line += (": above the device, so no re-plan gives a stage more layers or runs one at a smaller TP degree "
                 "(if the launch runs, the estimate overstates this job; --resihp-device-memory-gb sets what plans "
                 "are sized with)")
    return line
