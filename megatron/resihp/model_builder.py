"""Builds what one rank trains: megatron-core TransformerConfig, GPTModel, DDP, optimizer, LR schedule.

Responsible for turning validated arguments plus a per-stage layer split into megatron-core
objects. Kept as a function of (args, layers_per_stage) because an in-place adaptation rebuilds
all of it: megatron-core modules capture their process groups at construction. It must never
create or destroy process groups itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron.resihp.initialize import initialize_parameters

# megatron-core's own answer: its extension module imports without Transformer Engine (it puts
# stand-ins in its place), so importing from it proves nothing.
from megatron.core.models.gpt.gpt_layer_specs import HAVE_TE


@dataclasses.dataclass
class TrainingObjects:
    """What a rank holds for training; replaced whole on every rebuild."""

    config: TransformerConfig
    chunks: tuple[DistributedDataParallel, ...]  # the model's chunks on this rank: one per virtual stage
    optimizer: Any
    scheduler: OptimizerParamScheduler
    layers_per_stage: tuple[int, ...]
    # The Layout's number of each of megatron-core's layers (by its ``layer_number - 1``), where they
    # differ: the interleaved schedule places a stage's layers apart, and a Layout numbers them stage
    # by stage. None: the same numbers.
    layout_layer_of: tuple[int, ...] | None = None

    @property
    def model(self) -> DistributedDataParallel:
        """The one model chunk of a rank that runs one (every rank of the project's own loop)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank runs {len(self.chunks)} model chunks (the interleaved schedule): "
                             f"address them through TrainingObjects.chunks")
        return self.chunks[0]


def pipeline_layout(layers_per_stage: tuple[int, ...]) -> list[list[str]]:
    """megatron-core's per-stage layer list: embedding first, loss last, decoders between."""
    stages = [["decoder"] * n for n in layers_per_stage]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


def transformer_config(args: argparse.Namespace, layers_per_stage: tuple[int, ...]) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_model_parallel_layout=pipeline_layout(layers_per_stage) if len(layers_per_stage) > 1 else None,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        use_cpu_initialization=args.device == "cpu",
        # Per-token loss: replicas may run different micro-batch counts and still get exact grads.
        calculate_per_token_loss=True,
        batch_p2p_sync=args.device != "cpu",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def uses_te_layers(args: argparse.Namespace) -> bool:
    """Whether the model is built from Transformer Engine's layers: on CUDA, when TE is installed."""
    return args.device == "cuda" and HAVE_TE


def layer_spec(args: argparse.Namespace):
    use_te = uses_te_layers(args)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec()
    if not args.reset_attention_mask:
        return spec
    if use_te and getattr(args, "packed_seq_layout", "sbhd") == "thd":
        # TE's attention reads the document boundaries itself in the THD layout.
        return spec
    # Attention within each packed document, at a cost that follows sum(l_i^2): TE's attention
    # given samples as [s, b] would attend across documents, and the local spec's attends within
    # a mask at a cost of s^2.
    from megatron.resihp.models.document_attention import with_document_attention

    return with_document_attention(spec)


def decoder_spec(args: argparse.Namespace, config: TransformerConfig):
    """What GPTModel builds its decoder from. Given a layer spec alone, megatron-core picks the
    decoder's final norm itself, and it picks Transformer Engine's whenever TE is installed, which
    runs only on CUDA: a model whose layers are not TE's ends in the norm its layers use."""
    spec = layer_spec(args)
    if uses_te_layers(args):
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=spec.submodules.input_layernorm)


def build_model(args: argparse.Namespace, config: TransformerConfig) -> GPTModel:
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(args, config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if config.params_dtype != torch.float32:
        # What Megatron's Float16Module does to the module it wraps: norms built without
        # params_dtype (torch's LayerNorm, without Apex or TE) would otherwise stay fp32 and turn
        # the activations that pass through them back into fp32.
        model.to(dtype=config.params_dtype)
    if args.device == "cuda":
        model.cuda(torch.cuda.current_device())
    return model


def build_training_objects(args: argparse.Namespace, layers_per_stage: tuple[int, ...]) -> TrainingObjects:
    """Build config, DDP-wrapped model, optimizer and LR scheduler for the current groups."""
    config = transformer_config(args, layers_per_stage)
    model = build_model(args, config)
    # Before the optimizer copies any parameter into its own (fp32 main) state.
    initialize_parameters(
        model, args.seed, args.init_method_std, args.num_layers, tied=not args.untie_embeddings_and_output_weights
    )
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16 or args.fp16,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            fp16=args.fp16,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=False,
        ),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    gbs = args.global_batch_size
    warmup_iters = (
        int(args.lr_warmup_fraction * args.lr_decay_iters) if args.lr_warmup_fraction is not None else args.lr_warmup_iters
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return TrainingObjects(config, (ddp,), optimizer, scheduler, tuple(layers_per_stage))
