"""Document attention on a GPU: its layers never wait for the device; skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EOD = 0


def test_document_attention_layers_do_not_synchronise_the_device(one_rank):
    """Each layer reads the boundaries on the host and the micro-batch's row plan (one
    asynchronous copy for all layers); a per-layer ``cu_seqlens_q.tolist()`` or a copy of a
    pageable index tensor would wait for the stream, which sync-debug mode turns into an error."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.resihp.models.document_attention import DocumentCausalAttention, packed_seq_params_for

    config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, attention_dropout=0.0,
                               hidden_dropout=0.0)
    layers = [DocumentCausalAttention(config, n, AttnMaskType.causal, "self") for n in range(1, 5)]
    b, s = 2, 128
    tokens = torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0))
    tokens[0, [10, 11, 70]] = EOD
    tokens[1, [40, 90]] = EOD
    params = packed_seq_params_for(tokens, EOD, device=torch.device("cuda"))  # host tokens, as training does
    x = torch.randn(s, b, 4, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in layers:
            x = layer(x, x, x, None, packed_seq_params=params).view(s, b, 4, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x).all()
