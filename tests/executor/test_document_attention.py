"""Document attention equals block-diagonal causal attention, at a per-document cost."""

import dataclasses
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.resihp.models.document_attention import (  # noqa: E402
    DocumentCausalAttention,
    document_rows,
    flatten_for_thd,
    gpt_layer_spec,
    packed_seq_params_for,
    with_document_attention,
)

from tests.one_rank_world import one_rank_world  # noqa: E402

EOD = 0


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world with megatron's parallel state (TP=PP=1) on CPU."""
    with one_rank_world("gloo"):
        yield


def _config(**kw):
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _tokens(b, s, eod_positions, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (b, s), generator=g)
    for row, cols in eod_positions.items():
        tokens[row, cols] = EOD
    return tokens


def _block_causal_mask(tokens):
    """megatron's reset_attention_mask mask, [b, 1, s, s], True = hidden."""
    return torch.stack(
        [_get_ltor_masks_and_position_ids(t, EOD, False, True, False, True)[0] for t in tokens]
    )


@pytest.mark.parametrize("num_query_groups", [4, 2])
def test_matches_dot_product_attention_with_block_mask(one_rank, num_query_groups):
    config = _config(num_query_groups=num_query_groups)
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    doc = DocumentCausalAttention(config, 1, AttnMaskType.causal, "self")
    s, b = 48, 3
    tokens = _tokens(b, s, {0: [5, 6, 20], 1: [47], 2: [0, 9, 18, 27, 36]})
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(s, b, num_query_groups, 16, generator=g, requires_grad=True)
    v = torch.randn(s, b, num_query_groups, 16, generator=g, requires_grad=True)
    expected = ref(q, k, v, _block_causal_mask(tokens), AttnMaskType.causal)
    got = doc(q, k, v, None, AttnMaskType.causal, packed_seq_params=packed_seq_params_for(tokens, EOD))
    assert got.shape == (s, b, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Gradients flow through the per-document gather/scatter exactly as through the mask.
    (grad_ref,) = torch.autograd.grad(expected.square().sum(), q)
    (grad_doc,) = torch.autograd.grad(got.square().sum(), q)
    torch.testing.assert_close(grad_doc, grad_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_query_groups", [4, 2])
def test_thd_layout_attends_as_sbhd_does(one_rank, num_query_groups):
    """The flattened layout ([t, heads, dim], what megatron-core hands core attention for a thd
    ``packed_seq_params``) gives the rows of the sbhd result, sample after sample."""
    config = _config(num_query_groups=num_query_groups)
    doc = DocumentCausalAttention(config, 1, AttnMaskType.causal, "self")
    s, b = 40, 3
    tokens = _tokens(b, s, {0: [3, 4, 30], 1: [39], 2: [0, 12, 25]})
    g = torch.Generator().manual_seed(2)
    q = torch.randn(s, b, 4, 16, generator=g)
    k, v = (torch.randn(s, b, num_query_groups, 16, generator=g) for _ in range(2))
    sbhd = doc(q, k, v, None, packed_seq_params=packed_seq_params_for(tokens, EOD, "sbhd"))
    flat = (t.transpose(0, 1).reshape(b * s, t.size(2), 16) for t in (q, k, v))
    thd = doc(*flat, None, packed_seq_params=packed_seq_params_for(tokens, EOD, "thd"))
    assert thd.shape == (b * s, 64)
    torch.testing.assert_close(thd, sbhd.transpose(0, 1).reshape(b * s, 64), atol=1e-6, rtol=1e-6)


def test_layers_read_the_boundaries_on_the_host(one_rank):
    """Every layer needs the boundaries as integers; reading cu_seqlens_q back from a GPU in each
    layer would synchronise it. The params carry them on the host, and attention uses those."""
    doc = DocumentCausalAttention(_config(), 1, AttnMaskType.causal, "self")
    tokens = _tokens(2, 16, {0: [2, 9], 1: [4]})
    q = torch.randn(16, 2, 4, 16)
    params = packed_seq_params_for(tokens, EOD)
    assert params.bounds == tuple(params.cu_seqlens_q.tolist())
    assert params.cu_seqlens_q.dtype == torch.int32  # what Transformer Engine's kernels take, in sbhd too
    expected = doc(q, q, q, None, packed_seq_params=params)
    device_only = dataclasses.replace(params, cu_seqlens_q=None, cu_seqlens_kv=None)
    torch.testing.assert_close(doc(q, q, q, None, packed_seq_params=device_only), expected)
    plain = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=params.cu_seqlens_q)  # megatron-core's own type
    torch.testing.assert_close(doc(q, q, q, None, packed_seq_params=plain), expected)
    # Built from the host's tokens for a model elsewhere: the tensors go there, the bounds stay.
    elsewhere = packed_seq_params_for(tokens, EOD, "thd", device=torch.device("meta"))
    assert elsewhere.cu_seqlens_q.device.type == "meta" and elsewhere.bounds == params.bounds


def test_document_rows_group_equal_lengths_in_one_index():
    rows = document_rows([0, 4, 8, 10, 13], torch.device("cpu"))  # lengths 4, 4, 2, 3
    assert rows.groups == ((2, 1, 0), (3, 1, 2), (4, 2, 5))
    assert rows.index.tolist() == [8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rows.index.dtype == torch.int64


def test_layers_of_one_micro_batch_share_one_row_plan(one_rank, monkeypatch):
    """Each layer needs the same document rows; building them per layer costs, on CUDA, one
    host-to-device copy per distinct document length per layer, each waiting for the stream.
    The params build them once, for the first layer that asks."""
    import megatron.resihp.models.document_attention as module

    built = []
    monkeypatch.setattr(module, "document_rows", lambda *a: built.append(a) or document_rows(*a))
    config = _config()
    layers = [DocumentCausalAttention(config, n, AttnMaskType.causal, "self") for n in (1, 2, 3)]
    tokens = _tokens(2, 24, {0: [3, 9, 15], 1: [5, 11]})
    params = packed_seq_params_for(tokens, EOD)
    q = torch.randn(24, 2, 4, 16, requires_grad=True)
    out = q
    for layer in layers:
        out = layer(out, out, out, None, packed_seq_params=params).view(24, 2, 4, 16)
    out.square().sum().backward()
    assert len(built) == 1 and q.grad is not None
    # A plain PackedSeqParams has nowhere to keep them: each layer builds its own.
    plain = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=params.cu_seqlens_q)
    for layer in layers:
        layer(q, q, q, None, packed_seq_params=plain)
    assert len(built) == 4
    # New boundaries are never served the old plan.
    moved = dataclasses.replace(params, bounds=(0, 24, 48))
    assert moved.rows_on(q.device).groups == ((24, 2, 0),)


def test_thd_params_size_kernels_by_the_longest_document():
    tokens = _tokens(2, 16, {0: [2, 9], 1: [4]})  # documents 3, 7, 6 | 5, 11
    params = packed_seq_params_for(tokens, EOD, "thd")
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 10, 16, 21, 32]
    assert params.cu_seqlens_q.dtype == torch.int32  # what Transformer Engine's kernels take
    assert params.max_seqlen_q == params.max_seqlen_kv == 11
    assert packed_seq_params_for(tokens, EOD).max_seqlen_q == 16
    with pytest.raises(ValueError, match="layout"):
        packed_seq_params_for(tokens, EOD, "bshd")


def test_gpt_model_in_thd_layout_runs_each_document_as_its_own_sequence(one_rank):
    """Flattened micro-batch through GPTModel with rotary embeddings: each document's logits are
    those of the plain model given that document alone, positions from 0."""
    config = _config()
    kwargs = dict(config=config, vocab_size=128, max_sequence_length=32, position_embedding_type="rope")
    torch.manual_seed(0)
    plain = GPTModel(transformer_layer_spec=gpt_layer_spec(False), **kwargs)
    document = GPTModel(transformer_layer_spec=gpt_layer_spec(True), **kwargs)
    document.load_state_dict(plain.state_dict())
    tokens = _tokens(2, 32, {0: [7, 8, 30], 1: [15]})
    params = packed_seq_params_for(tokens, EOD, "thd")
    (flat,) = flatten_for_thd(tokens)
    got = document(flat, None, None, packed_seq_params=params)  # [1, t, vocab]
    assert got.shape == (1, 64, 128)
    bounds = params.cu_seqlens_q.tolist()
    for start, end in zip(bounds, bounds[1:]):
        alone = flat[:, start:end]
        expected = plain(alone, torch.arange(end - start)[None], None)
        torch.testing.assert_close(got[:, start:end], expected, atol=1e-5, rtol=1e-5)


def test_work_scales_with_sum_of_squares_not_s_squared(one_rank):
    doc = DocumentCausalAttention(_config(), 1, AttnMaskType.causal, "self")
    s, b = 256, 2
    q = k = v = torch.randn(s, b, 4, 16)
    # 16 documents of 16 tokens per sample: one batched call, 2 * 16 * 16^2 scored pairs.
    short = _tokens(b, s, {0: list(range(15, s, 16)), 1: list(range(15, s, 16))})
    doc(q, k, v, None, packed_seq_params=packed_seq_params_for(short, EOD))
    assert doc.last_num_attention_calls == 1
    assert doc.last_num_score_entries == 2 * 16 * 16**2
    # One document per sample: the full s^2.
    whole = _tokens(b, s, {})
    doc(q, k, v, None, packed_seq_params=packed_seq_params_for(whole, EOD))
    assert doc.last_num_score_entries == 2 * s * s
    # Mixed lengths: one call per distinct length.
    mixed = _tokens(b, s, {0: [9, 19, 99], 1: [9, 255]})
    doc(q, k, v, None, packed_seq_params=packed_seq_params_for(mixed, EOD))
    lengths = [10, 10, 80, 156, 10, 246]
    assert doc.last_num_attention_calls == len(set(lengths))
    assert doc.last_num_score_entries == sum(l * l for l in lengths)


def test_without_boundaries_it_is_plain_causal(one_rank):
    config = _config()
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    doc = DocumentCausalAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(16, 2, 4, 16) for _ in range(3))
    mask = _block_causal_mask(_tokens(2, 16, {}))
    torch.testing.assert_close(doc(q, k, v, None), ref(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(doc(q, k, v, mask), ref(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_rejects_bad_boundaries(one_rank):
    doc = DocumentCausalAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.randn(8, 1, 4, 16)
    params = packed_seq_params_for(_tokens(1, 8, {0: [3]}), EOD)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        doc(q, q, q, None, packed_seq_params=dataclasses.replace(params, bounds=(0, 3, 7)))
    # A plain PackedSeqParams (no host bounds): its cu_seqlens_q is read and checked.
    plain = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        doc(q, q, q, None, packed_seq_params=plain)
    params.qkv_format = "bshd"
    with pytest.raises(ValueError, match="'sbhd' or 'thd'"):
        doc(q, q, q, None, packed_seq_params=params)
    params = packed_seq_params_for(_tokens(1, 8, {0: [3]}), EOD, "thd")
    with pytest.raises(ValueError, match="does not match"):  # a thd layout takes [t, heads, dim]
        doc(q, q, q, None, packed_seq_params=params)


def test_gpt_model_forward_with_packed_seq_params(one_rank):
    """Through GPTModel (rotary embeddings on): same logits as the local spec with the mask."""
    config = _config()
    kwargs = dict(
        config=config, vocab_size=128, max_sequence_length=32, position_embedding_type="rope",
    )
    torch.manual_seed(0)
    plain = GPTModel(transformer_layer_spec=gpt_layer_spec(False), **kwargs)
    document = GPTModel(transformer_layer_spec=gpt_layer_spec(True), **kwargs)
    document.load_state_dict(plain.state_dict())
    assert isinstance(
        document.decoder.layers[0].self_attention.core_attention, DocumentCausalAttention
    )
    tokens = _tokens(2, 32, {0: [7, 8, 30], 1: [15]})
    position_ids = torch.arange(32).expand(2, 32)
    expected = plain(tokens, position_ids, _block_causal_mask(tokens))
    got = document(tokens, position_ids, None, packed_seq_params=packed_seq_params_for(tokens, EOD))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _mlp_submodules(layer_spec):
    # megatron-core 0.16 describes the MLP as a ModuleSpec; 0.19 as a partial of
    # MLP.as_mlp_submodule holding the same submodules.
    mlp = layer_spec.submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def test_document_attention_replaces_only_the_core_attention_of_a_spec():
    """The swap a CUDA job with Transformer Engine also gets: projections and MLP stay the spec's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    plain = get_gpt_layer_local_spec()
    swapped = with_document_attention(get_gpt_layer_local_spec())
    assert swapped.submodules.self_attention.submodules.core_attention is DocumentCausalAttention
    assert plain.submodules.self_attention.submodules.core_attention is DotProductAttention
    for name in ("linear_qkv", "linear_proj"):
        assert getattr(swapped.submodules.self_attention.submodules, name) is getattr(
            plain.submodules.self_attention.submodules, name)
    assert _mlp_submodules(swapped).linear_fc1 is _mlp_submodules(plain).linear_fc1
    with pytest.raises(ValueError, match="SelfAttention layers only"):
        with_document_attention(get_gpt_layer_local_spec(multi_latent_attention=True))


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_every_layer_of_a_decoder_attends_within_documents_only_when_packing_is_on(monkeypatch, layout):
    """What the model provider of Megatron-LM's loop builds (``packed_documents.with_document_attention``
    on megatron-core's decoder block spec): without Transformer Engine our attention reads both layouts."""
    import argparse

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron.resihp import gpt_pretrain, packed_documents

    monkeypatch.setattr(gpt_pretrain, "has_transformer_engine", lambda: False)

    def cores(reset):
        args = argparse.Namespace(device="cpu", reset_attention_mask=reset, packed_seq_layout=layout,
                                  transformer_impl="local", bf16=False, fp16=False)
        block = get_gpt_decoder_block_spec(_config(num_layers=3), use_transformer_engine=False)
        block = packed_documents.with_document_attention(block, args)
        return [layer.submodules.self_attention.submodules.core_attention for layer in block.layer_specs]

    assert cores(True) == [DocumentCausalAttention] * 3
    assert cores(False) == [DotProductAttention] * 3
