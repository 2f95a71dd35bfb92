"""Packed documents on Megatron-LM's loop: variable-length mock documents, and attention kept
within each document at every pipeline stage.

Responsible for what a job that packs several documents into each sample adds to Megatron's
``pretrain()``:

- ``--mock-doc-lengths``: ``--mock-data`` documents whose lengths follow a distribution
  (``resihp_ext.workload``), each ending in EOD (``data.datasets.VariableLengthMockGPTDataset``).
- With ``--reset-attention-mask``, attention within each document
  (``models.document_attention``), at a cost of ``sum(l_i^2)`` rather than ``s^2``. Megatron's
  batch reaches only the first and last pipeline stages (the last without its tokens), so a
  middle stage would attend across documents; here every stage reads the micro-batch, finds the
  documents from its tokens (``packed_seq_params``) and records their cost features, which the
  detector and planner read (``schedules.RECORDER``).
- ``--packed-seq-layout``: ``sbhd`` keeps samples as [s, b]; ``thd`` flattens each micro-batch to
  one sequence, the layout Transformer Engine's attention reads document boundaries in. Megatron's
  pipeline schedules size what stages send each other as [s, b, h]; under ``thd`` a stage's
  activations are [b * s, 1, h], so the schedules are given that shape (``install``).

What it cannot carry is refused with the reason (``refusal``) before anything starts.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

LAYOUTS = ("auto", "sbhd", "thd")


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of packed documents, for Megatron's ``extra_args_provider``."""
    group = parser.add_argument_group(title="packed documents")
    group.add_argument("--mock-doc-lengths", type=str, default=None, metavar="SPEC",
                       help="with --mock-data: documents whose lengths follow SPEC, e.g. "
                            "lognormal:median=48,sigma=1.0,min=8,max=1024 (or fixed:length=N), each ending in EOD")
    group.add_argument("--packed-seq-layout", choices=LAYOUTS, default="auto",
                       help="with --reset-attention-mask: how a micro-batch of packed documents reaches attention. "
                            "sbhd keeps samples as [s, b]; thd flattens each micro-batch to one sequence [b*s], the "
                            "layout Transformer Engine's attention reads document boundaries in. auto: thd on CUDA "
                            "with Transformer Engine and --bf16/--fp16, sbhd otherwise")
    return parser


def document_attention(args: argparse.Namespace) -> bool:
    """Whether attention stays within each packed document (``--reset-attention-mask``)."""
    return bool(args.reset_attention_mask)


def layout(args: argparse.Namespace) -> str:
    """``--packed-seq-layout`` resolved: ``auto`` is thd where Transformer Engine runs attention in
    half precision (its THD kernels take nothing else), sbhd otherwise."""
    if args.packed_seq_layout != "auto":
        return args.packed_seq_layout
    half = args.bf16 or args.fp16
    return "thd" if document_attention(args) and _te_attention(args) and half else "sbhd"


def _te_attention(args: argparse.Namespace) -> bool:
    from megatron.resihp.gpt_pretrain import has_transformer_engine

    return args.device == "cuda" and args.transformer_impl == "transformer_engine" and has_transformer_engine()


def refusal(args: argparse.Namespace) -> str | None:
    """Why this job's packed-document flags cannot run as asked (one message naming the flag and the
    fix), or None."""
    from resihp_ext.workload import LengthDistribution

    if args.mock_doc_lengths is not None:
        if not args.mock_data:
            return "--mock-doc-lengths only applies with --mock-data; add --mock-data or drop it"
        try:
            LengthDistribution.parse(args.mock_doc_lengths)
        except ValueError as error:
            return str(error)
    if not document_attention(args):
        if args.packed_seq_layout == "thd":
            return ("--packed-seq-layout thd needs --reset-attention-mask (documents to attend within); add it or "
                    "drop --packed-seq-layout")
        return None
    if layout(args) == "thd" and _te_attention(args) and not (args.bf16 or args.fp16):
        return ("--packed-seq-layout thd on CUDA with Transformer Engine needs --bf16 or --fp16 (TE's THD "
                "attention kernels take half precision); add one or use --packed-seq-layout sbhd")
    return _attention_refusal(args)


# megatron-core's pipeline schedules, each called with keyword arguments by Megatron's train() and
# evaluate() (and by this project's loop) through ``get_forward_backward_func``, which reads these
# module attributes at every call.
_PIPELINE_SCHEDULES = ("forward_backward_pipelining_without_interleaving",
                       "forward_backward_pipelining_with_interleaving")
_ORIGINAL: dict[str, Callable] = {}


def install(args: argparse.Namespace) -> None:
    """Under ``thd`` with pipeline stages, give Megatron's pipeline schedules a stage's activation
    shape, [b * s, 1, h] (they size the tensors stages exchange from ``seq_length`` and
    ``micro_batch_size``; a stage receiving [s, b, h] would read another layout, and the backward
    would meet a gradient of another shape). Nothing otherwise. Idempotent."""
    if _ORIGINAL or not document_attention(args) or layout(args) != "thd" or args.pipeline_model_parallel_size == 1:
        return
    from megatron.core.pipeline_parallel import schedules

    for name in _PIPELINE_SCHEDULES:
        original = getattr(schedules, name)
        _ORIGINAL[name] = original
        setattr(schedules, name, functools.wraps(original)(functools.partial(_one_sequence_per_microbatch, original)))


def _one_sequence_per_microbatch(schedule: Callable, *args, seq_length: int, micro_batch_size: int, **kwargs):
    return schedule(*args, seq_length=seq_length * micro_batch_size, micro_batch_size=1, **kwargs)


def _attention_refusal(args: argparse.Namespace) -> str | None:
    if args.context_parallel_size > 1:
        return ("--reset-attention-mask with --context-parallel-size > 1: attention within each packed document "
                "does not split a sequence over ranks; drop one of them")
    if args.num_experts:
        return ("--reset-attention-mask with --num-experts: attention within each packed document is built for "
                "dense GPT layers; drop one of them")
    if args.multi_latent_attention:
        return ("--reset-attention-mask with --multi-latent-attention: attention within each packed document "
                "needs Megatron's SelfAttention; drop one of them")
    if args.window_size is not None:
        return "--reset-attention-mask with --window-size: attention within each packed document has no sliding window"
    return None


def with_document_attention(block_spec, args: argparse.Namespace):
    """``block_spec`` (a decoder block's spec from ``get_gpt_decoder_block_spec``) with every
    layer's core attention kept within each document; unchanged where attention does not stay
    within documents, or where Transformer Engine reads the boundaries itself (thd)."""
    from megatron.resihp.models.document_attention import with_document_attention as swap

    if not document_attention(args) or layout(args) == "thd" and _te_attention(args):
        return block_spec
    for layer in block_spec.layer_specs:
        swap(layer)
    return block_spec


def every_stage_reads(args: argparse.Namespace) -> bool:
    """Whether every pipeline stage reads the micro-batch (it needs the documents' bounds), not
    only the first and last."""
    return document_attention(args) and args.pipeline_model_parallel_size > 1


def forward(model, batch: dict, args: argparse.Namespace, first: bool, last: bool):
    """The micro-batch ``batch`` (every tensor of it, on every stage) through ``model`` with
    attention kept within its documents; its cost features are recorded. Returns the model's
    output and the loss mask the loss is taken with (None before the last stage)."""
    from megatron.resihp.data.batch import microbatch_features
    from megatron.resihp.models.document_attention import flatten_for_thd, packed_seq_params_for
    from megatron.resihp.schedules import RECORDER

    from megatron.training import get_tokenizer

    packing = layout(args)
    tokens = batch["tokens"]
    params = packed_seq_params_for(tokens.cpu(), get_tokenizer().eod, packing, device=tokens.device)
    if RECORDER.active:
        RECORDER.features.append(microbatch_features(params.bounds))
    labels, loss_mask, position_ids = batch["labels"], batch["loss_mask"], batch["position_ids"]
    if packing == "thd":
        tokens, labels, loss_mask, position_ids = flatten_for_thd(tokens, labels, loss_mask, position_ids)
    # A stage is given what stock Megatron gives it, with the documents' bounds in place of a mask.
    output = model(tokens if first else None, position_ids if first else None, None,
                   labels=labels if last else None, packed_seq_params=params)
    return output, loss_mask if last else None


def recorded_features(columns: int, chunks: int) -> list | None:
    """The cost features the forward steps of this iteration recorded, one per op column, or None
    when they did not record one per column, or ran ``chunks`` > 1 model chunks (the interleaved
    schedule runs them out of the columns' order)."""
    from megatron.resihp.schedules import RECORDER

    return list(RECORDER.features) if chunks == 1 and len(RECORDER.features) == columns else None
