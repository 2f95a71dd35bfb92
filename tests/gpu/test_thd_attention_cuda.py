"""Transformer Engine's THD attention attends within each document as our document attention
does; skipped without a GPU and Transformer Engine."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EOD = 0


def test_te_thd_attention_matches_document_attention(one_rank):
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.resihp.models.document_attention import DocumentCausalAttention, packed_seq_params_for

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, attention_dropout=0.0,
                               hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    te_attention = TEDotProductAttention(config, 1, AttnMaskType.causal, "self")
    document = DocumentCausalAttention(config, 1, AttnMaskType.causal, "self")
    b, s = 2, 128
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 100, (b, s), generator=g)
    tokens[0, [10, 11, 70]] = EOD
    tokens[1, [40]] = EOD
    tokens = tokens.cuda()
    params = packed_seq_params_for(tokens, EOD, "thd")
    q, k, v = (torch.randn(b * s, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    got = te_attention(q, k, v, None, AttnMaskType.causal, packed_seq_params=params).reshape(b * s, -1)
    expected = document(q, k, v, None, packed_seq_params=params).reshape(b * s, -1)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # One causal attention over the whole flattened batch is clearly different: the test sees documents.
    whole = packed_seq_params_for(torch.ones_like(tokens.view(1, -1)), EOD, "thd")
    crossing = document(q, k, v, None, packed_seq_params=whole).reshape(b * s, -1)
    assert (crossing.float() - expected.float()).abs().max() > 0.1
