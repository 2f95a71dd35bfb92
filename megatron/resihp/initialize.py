"""Process start-up: the default process group, megatron-core's parallel state, seeds, and a
parameter initialisation that does not depend on the parallel layout.

Responsible for everything a rank does once before building its model. Layout-independent
initialisation matters twice: a TP1/PP1 run and a TP2/PP2 run start from the same weights (so
parallelism can be checked exactly), and after an in-place re-plan every parameter still has one
identity, its name in the unsharded model.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron.resihp import cpu_affinity, cpu_mode, host_memory
from megatron.resihp.logging_utils import exit_with_error


def world_backend(device: str) -> str:
    """The default group's backend: gloo on CPU; on CUDA, NCCL for GPU tensors and gloo for the
    host tensors that the loss sum, detection's messages and re-planning exchange (NCCL alone
    rejects a host tensor, and every group made without a backend inherits both)."""
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def initialize_distributed(args: argparse.Namespace) -> None:
    """Join the job's default group (torchrun-style env) and build megatron-core's groups."""
    if args.device == "cpu":
        cpu_mode.enable()
        host_memory.keep_freed_memory()
        torch.set_num_threads(int(os.environ.get("RESIHP_CPU_THREADS", "1")))
        try:
            cpu_affinity.pin_this_rank()
        except ValueError as error:
            exit_with_error(str(error))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.resihp.enable:
        # Survivors of a fail-stop learn of it from a failed collective: bound every wait.
        args.distributed_timeout_minutes = args.resihp.collective_timeout_s / 60.0
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rendezvous = {}
        if "MASTER_ADDR" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but no MASTER_ADDR/MASTER_PORT: launch with torchrun or "
                    "scripts/launch_local.py, which set them"
                )
            rendezvous["store"] = dist.HashStore()  # a plain `python pretrain_gpt_resilient.py` run
        dist.init_process_group(
            backend=world_backend(args.device),
            rank=int(os.environ.get("RANK", "0")),
            world_size=world_size,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
            **rendezvous,
        )
    args.rank = dist.get_rank()
    # The same group builder every later re-plan uses (memberships equal initialize_model_parallel's).
    from megatron.resihp.parallel_state_patch import build_groups, install

    args.layout = initial_layout(args)
    args.groups = build_groups(args.layout, args.rank, timeout=args.distributed_timeout_minutes * 60.0)
    install(args.groups)


def initial_layout(args: argparse.Namespace):
    """The Layout the flags describe: megatron-core's rank order (tp fastest, then dp, then pp)."""
    from resihp_ext.layout import Layout, ModelSpec

    model = ModelSpec(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
    )
    return Layout.uniform(model, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          args.data_parallel_size, tuple(args.layers_per_stage))


def set_random_seed(seed: int) -> None:
    """Megatron's seeding: distinct per pipeline stage, TP-aware tracker for dropout."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _global_name(name: str, local_to_global_layer: dict[int, int]) -> str:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers") + 1
        parts[i] = str(local_to_global_layer[int(parts[i])])
    if parts[:2] == ["output_layer", "weight"]:
        return name  # untied output layer; tied copies are handled by the caller
    return ".".join(parts)


def _scaled_output(name: str) -> bool:
    return name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, seed: int, init_method_std: float, num_layers: int, tied: bool) -> None:
    """Re-initialise every parameter from a generator keyed by its unsharded name.

    Each rank draws the full (unsharded) tensor and keeps its TP slice, as megatron-core's CPU
    initialisation does, so any TP/PP split of the same model starts from identical weights.
    Matrices ~ N(0, std) (output projections std / sqrt(2 * num_layers)), norm weights 1, biases 0.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, param in model.named_parameters():
        key = _global_name(name, local_to_global)
        if tied and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"
        full_shape = list(param.shape)
        partitioned = getattr(param, "tensor_model_parallel", False)
        if partitioned:
            full_shape[param.partition_dim] *= tp_size
        if param.dim() == 1:
            value = torch.ones(full_shape) if "norm" in key and key.endswith("weight") else torch.zeros(full_shape)
        else:
            digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            std = init_method_std / (2.0 * num_layers) ** 0.5 if _scaled_output(key) else init_method_std
            value = torch.empty(full_shape).normal_(0.0, std, generator=gen)
        if partitioned:
            value = value.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        param.copy_(value.to(param.dtype))
