"""Causal attention within each packed document, at a cost of sum(l_i^2), not s^2.

Responsible for the core-attention step (softmax(QK^T)V) of megatron-core's local GPT layer when
samples pack several documents: every token attends causally to earlier tokens of its own
document only, and the work done is one causal attention per document, so a micro-batch costs
``~ sum_i l_i^2`` as the ResiHP time model assumes. It does not project, rotate or shard anything;
megatron-core's ``SelfAttention`` around it still does that.

How document boundaries arrive: the forward step passes
``packed_seq_params=packed_seq_params_for(tokens, eod, layout)`` to ``GPTModel.forward``, in one
of two layouts (``--packed-seq-layout``):

- ``sbhd``: tensors stay [s, b, ...], so megatron-core's attention and rotary code run their
  ordinary path; ``cu_seqlens_q``/``cu_seqlens_kv`` mark the segment boundaries over the batch
  flattened sample by sample and ``max_seqlen_q``/``max_seqlen_kv`` equal ``s`` (megatron sizes
  its rotary table from them).
- ``thd``: the forward step flattened the micro-batch to one sequence of ``t = b * s`` tokens
  (tokens [1, t]), so megatron-core hands this module [t, heads, dim] and applies rotary
  embeddings per document; the same ``cu_seqlens``, ``max_seqlen`` the longest document. This
  is the layout Transformer Engine's own attention reads, so one data path serves both.

Without ``packed_seq_params`` the module falls back to one attention over the whole sample,
using the given mask if any (so it is also a plain drop-in for ``DotProductAttention``).

Limits: no context parallelism, sliding windows or non-vanilla softmax (construction raises);
attention dropout uses the CUDA RNG tracker like ``DotProductAttention``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from megatron.resihp.data.batch import document_bounds


@dataclasses.dataclass(frozen=True)
class DocumentRows:
    """Where each packed document's rows are, grouped for batched attention.

    Attributes:
        groups: ``(length, count, offset)`` per distinct document length, ascending: ``count``
            documents of ``length`` rows whose row numbers are ``index[offset:offset + count * length]``,
            document after document.
        index: Every row number, in the order of ``groups`` (a permutation of ``0..t-1``); on the
            device attention runs on.
    """

    groups: tuple[tuple[int, int, int], ...]
    index: Tensor


def document_rows(bounds, device: torch.device) -> DocumentRows:
    """The rows of the documents between consecutive ``bounds``, built on the host and sent to
    ``device`` in one copy (asynchronous from pinned memory on CUDA)."""
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds, bounds[1:]):
        starts_by_length[end - start].append(start)
    groups, parts, offset = [], [], 0
    for length in sorted(starts_by_length):
        starts = torch.tensor(starts_by_length[length], dtype=torch.int64)
        parts.append((starts[:, None] + torch.arange(length)).reshape(-1))
        groups.append((length, len(starts_by_length[length]), offset))
        offset += parts[-1].numel()
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory()  # so the copy below need not wait for the stream
    return DocumentRows(tuple(groups), index.to(device, non_blocking=True))


@dataclasses.dataclass
class DocumentBounds(PackedSeqParams):
    """``PackedSeqParams`` that also holds the document boundaries as host integers, and the row
    plan built from them once per micro-batch and device (``rows_on``), so every layer's document
    attention finds its documents without reading ``cu_seqlens_q`` back from the device or copying
    index tensors to it (on CUDA each such copy from pageable memory waits for the stream).
    Transformer Engine and megatron-core read only the ``PackedSeqParams`` fields."""

    bounds: tuple[int, ...] = ()
    _rows: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def rows_on(self, device: torch.device) -> DocumentRows:
        """The row plan of ``bounds`` on ``device``, built by the first layer that asks."""
        rows = self._rows.get(device)
        if rows is None:
            rows = self._rows[device] = document_rows(self.bounds, device)
        return rows


class DocumentCausalAttention(MegatronModule):
    """Core attention computing causal attention per document.

    Constructor and forward match ``megatron.core.transformer.dot_product_attention.
    DotProductAttention``; see the module docstring for what ``packed_seq_params`` must hold.

    Attributes:
        last_num_attention_calls: Attention kernels launched by the latest forward (one per
            distinct document length), for observing the cost structure.
        last_num_score_entries: Query-key pairs scored by the latest forward, per head and
            sample batch: ``sum_i l_i^2``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "document attention does not support --context-parallel-size > 1; drop "
                "--document-attention or use context parallel size 1"
            )
        if config.window_size is not None:
            raise ValueError("document attention does not support --window-size; drop one of them")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("document attention supports only --softmax-type vanilla")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp_degree = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_degree)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_degree)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_degree)
        # DotProductAttention divides by layer_number under apply_query_key_layer_scaling and
        # multiplies it back inside the softmax; the net scale is this one.
        self.softmax_scale = (
            softmax_scale
            if softmax_scale is not None
            else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.last_num_attention_calls = 0
        self.last_num_score_entries = 0

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attend.

        Args:
            query: [s, b, heads_per_partition, head_dim], or [t, heads_per_partition, head_dim]
                in the ``thd`` layout.
            key, value: The same with query_groups_per_partition heads.
            attention_mask: Ignored when ``packed_seq_params`` is given; otherwise a boolean
                mask broadcastable to [b, heads, s, s] (True = masked out), or None for causal.
            attn_mask_type: Unused, as in ``DotProductAttention``.
            attention_bias: Not supported (must be None).
            packed_seq_params: Document boundaries, from :func:`packed_seq_params_for`.

        Returns:
            [s, b, hidden_per_partition], or [t, hidden_per_partition] in the ``thd`` layout.
        """
        if attention_bias is not None:
            raise ValueError("document attention does not support attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed_seq_params is not None and packed_seq_params.qkv_format not in (None, "sbhd", "thd"):
            raise ValueError(
                f"document attention reads packed_seq_params.qkv_format 'sbhd' or 'thd'; got "
                f"{packed_seq_params.qkv_format!r}. Build it with packed_seq_params_for(tokens, eod, layout)"
            )
        if thd != (query.dim() == 3):
            raise ValueError(
                f"query of shape {tuple(query.shape)} does not match packed_seq_params.qkv_format "
                f"{packed_seq_params.qkv_format if packed_seq_params else None!r}: 'thd' takes "
                "[t, heads, dim], otherwise [s, b, heads, dim]"
            )
        heads = self.num_attention_heads_per_partition
        repeat = heads // self.num_query_groups_per_partition
        if repeat > 1:  # grouped-query attention: share each K/V group among its query heads
            key = key.repeat_interleave(repeat, dim=-2)
            value = value.repeat_interleave(repeat, dim=-2)
        out_dtype = query.dtype
        if self.config.attention_softmax_in_fp32 and query.dtype in (torch.float16, torch.bfloat16):
            query, key, value = query.float(), key.float(), value.float()
        dropout_p = self.dropout_p if self.training else 0.0
        hidden = heads * self.hidden_size_per_attention_head

        if thd:
            context = self._per_document(query, key, value, packed_seq_params, dropout_p)
            return context.reshape(query.size(0), hidden).to(out_dtype)
        seq_length, batch = query.size(0), query.size(1)
        if packed_seq_params is None:
            context = self._whole_sample(query, key, value, attention_mask, dropout_p)
        else:
            # Flat sample-major [b * s, h, d], so a document is a contiguous row range.
            flat = (t.transpose(0, 1).reshape(batch * seq_length, heads, -1) for t in (query, key, value))
            context = self._per_document(*flat, packed_seq_params, dropout_p)
        # context: [b * s, heads, head_dim] in flat sample-major order -> [s, b, hidden].
        context = context.view(batch, seq_length, hidden)
        return context.transpose(0, 1).contiguous().to(out_dtype)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float) -> Tensor:
        """SDPA on [n, heads, l, d]; causal when no mask is given."""
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Same RNG stream choice as DotProductAttention: per-TP-rank dropout.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                    scale=self.softmax_scale,
                )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
            scale=self.softmax_scale,
        )

    def _whole_sample(self, query, key, value, attention_mask, dropout_p) -> Tensor:
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # megatron's masks mark positions to hide; SDPA's boolean masks mark positions to keep.
        mask = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, mask, dropout_p)
        self.last_num_attention_calls = 1
        self.last_num_score_entries = q.size(0) * q.size(2) * q.size(2)
        return out.permute(0, 2, 1, 3).reshape(-1, q.size(1), q.size(3))

    def _per_document(self, q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams, dropout_p) -> Tensor:
        """Causal attention per document of ``params`` over rows of [t, heads, dim]; returns the same shape."""
        total, heads, head_dim = q.shape
        bounds = _bounds(params)
        if bounds[0] != 0 or bounds[-1] != total or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"packed_seq_params.cu_seqlens_q must rise strictly from 0 to the token count {total}; "
                f"got {bounds[:4]}...{bounds[-2:]}. Build it with packed_seq_params_for(tokens, eod, layout)"
            )
        rows = (params.rows_on(q.device) if isinstance(params, DocumentBounds) and params.bounds
                else document_rows(bounds, q.device))
        # Documents of equal length share one batched kernel call: the number of calls is the
        # number of distinct lengths, and each call scores n * l^2 pairs, never l * s.
        pieces = []
        for length, n, offset in rows.groups:
            index = rows.index[offset:offset + n * length]
            qs, ks, vs = (
                t.index_select(0, index).view(n, length, heads, head_dim).transpose(1, 2)
                for t in (q, k, v)
            )
            out = self._sdpa(qs, ks, vs, None, dropout_p)  # [n, h, l, d]
            pieces.append(out.transpose(1, 2).reshape(n * length, heads, head_dim))
        context = torch.zeros_like(q).index_copy(0, rows.index, torch.cat(pieces))
        self.last_num_attention_calls = len(rows.groups)
        self.last_num_score_entries = sum(length * length * n for length, n, _ in rows.groups)
        return context


def _bounds(params: PackedSeqParams) -> list[int]:
    if isinstance(params, DocumentBounds) and params.bounds:
        return list(params.bounds)
    cu = params.cu_seqlens_q
    return cu.tolist() if isinstance(cu, Tensor) else list(cu)


PACKED_SEQ_LAYOUTS = ("sbhd", "thd")


def packed_seq_params_for(tokens: Tensor, eod: int, layout: str = "sbhd",
                          device: Optional[torch.device] = None) -> PackedSeqParams:
    """What the forward step passes to ``GPTModel.forward`` as ``packed_seq_params``.

    Args:
        tokens: LongTensor [b, s] of the micro-batch as the data loader gave it (the EOD belongs
            to the document it ends), before any flattening.
        eod: The tokenizer's EOD id.
        layout: ``"sbhd"`` (the model sees [s, b]) or ``"thd"`` (the forward step hands the model
            the micro-batch flattened to [1, b * s]; see :func:`flatten_for_thd`).
        device: Where ``cu_seqlens`` go (default: the tokens'). Pass the host's tokens and the
            model's device, and finding the boundaries waits for nothing on the GPU.

    Returns:
        ``DocumentBounds(qkv_format=layout, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m,
        max_seqlen_kv=m, bounds=...)``: ``cu`` (int32, on ``device``) holds
        :func:`megatron.resihp.data.batch.document_bounds`, which ``bounds`` keeps on the host;
        ``m`` = ``s`` for sbhd, the longest document for thd.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, s], got shape {tuple(tokens.shape)}")
    if layout not in PACKED_SEQ_LAYOUTS:
        raise ValueError(f"packed sequence layout must be one of {PACKED_SEQ_LAYOUTS}, got {layout!r}")
    bounds = document_bounds(tokens, eod)
    cu = torch.tensor(bounds, dtype=torch.int32, device=tokens.device if device is None else device)
    # thd: attention kernels and the per-document rotary table are sized by the longest document.
    # sbhd: by s (not the longest document): megatron sizes the rotary table from it and applies
    # it to all s positions of the unpacked [s, b] tensors.
    max_seqlen = max(b - a for a, b in zip(bounds, bounds[1:])) if layout == "thd" else tokens.size(1)
    return DocumentBounds(
        qkv_format=layout, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
        bounds=tuple(bounds),
    )


def flatten_for_thd(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each [b, s] tensor of a micro-batch (tokens, labels, loss mask, position ids) as [1, b * s],
    samples one after another: the shape GPTModel takes with a ``thd`` ``packed_seq_params``."""
    return tuple(t.reshape(1, -1) for t in tensors)


def gpt_layer_spec(document_attention: bool, **local_spec_kwargs) -> ModuleSpec:
    """megatron-core's local GPT layer spec, with document attention when asked.

    Args:
        document_attention: Swap ``DotProductAttention`` for :class:`DocumentCausalAttention`.
        **local_spec_kwargs: Passed to ``get_gpt_layer_local_spec`` (e.g. ``normalization``,
            ``qk_layernorm``).

    Returns:
        The layer spec. Raises ValueError for document attention in a mixture-of-experts layer
        (``num_experts``), which keeps ``SelfAttention``; multi-latent attention is refused by
        ``with_document_attention``.
    """
    if document_attention and local_spec_kwargs.get("num_experts"):
        raise ValueError("document attention supports dense GPT layers only, not num_experts")
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    return with_document_attention(spec) if document_attention else spec


def with_document_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec``, a dense GPT layer spec (megatron-core's local or Transformer Engine one), with its
    core attention swapped for :class:`DocumentCausalAttention`; projections, norms and the MLP
    stay what the spec built. Raises ValueError for a layer whose attention is not ``SelfAttention``
    (multi-latent attention)."""
    attention = spec.submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(f"document attention supports SelfAttention layers only, got {attention.module.__name__}")
    attention.submodules.core_attention = DocumentCausalAttention
    return spec
