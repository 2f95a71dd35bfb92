"""--packed-seq-layout resolves to the layout the job's attention can read documents in, and what
cannot run is refused naming the flag and the fix (``megatron/resihp/packed_documents.py``)."""

import argparse

import pytest

from megatron.resihp import gpt_pretrain, packed_documents


def _args(layout="auto", device="cpu", reset=True, bf16=False, fp16=False, stages=1, **extra):
    values = dict(packed_seq_layout=layout, device=device, reset_attention_mask=reset, bf16=bf16, fp16=fp16,
                  transformer_impl="transformer_engine", pipeline_model_parallel_size=stages, mock_doc_lengths=None,
                  mock_data=True, context_parallel_size=1, num_experts=None, multi_latent_attention=False,
                  window_size=None)
    values.update(extra)
    return argparse.Namespace(**values)


@pytest.fixture
def with_te(monkeypatch):
    """Transformer Engine seen as installed (it cannot be installed on a machine without CUDA)."""
    monkeypatch.setattr(gpt_pretrain, "has_transformer_engine", lambda: True)


def test_auto_without_transformer_engine_is_sbhd(monkeypatch):
    monkeypatch.setattr(gpt_pretrain, "has_transformer_engine", lambda: False)
    for device in ("cpu", "cuda"):
        assert packed_documents.layout(_args(device=device, bf16=True)) == "sbhd"
    assert packed_documents.layout(_args(layout="thd")) == "thd"  # our document attention reads it


def test_auto_picks_thd_where_transformer_engine_can_run_it(with_te):
    assert packed_documents.layout(_args(device="cuda", bf16=True)) == "thd"
    assert packed_documents.layout(_args(device="cuda", fp16=True)) == "thd"
    assert packed_documents.layout(_args(device="cuda")) == "sbhd"  # fp32: TE has no THD kernel
    assert packed_documents.layout(_args(device="cuda", bf16=True, reset=False)) == "sbhd"
    assert packed_documents.layout(_args(device="cpu", bf16=True)) == "sbhd"
    assert packed_documents.layout(_args(device="cuda", bf16=True, transformer_impl="local")) == "sbhd"
    assert packed_documents.layout(_args(layout="sbhd", device="cuda", bf16=True)) == "sbhd"


@pytest.mark.parametrize("args, says", [
    (_args(layout="thd", reset=False), "--packed-seq-layout thd needs --reset-attention-mask"),
    (_args(layout="thd", device="cuda"), "needs --bf16 or --fp16"),
    (_args(context_parallel_size=2), "--context-parallel-size"),
    (_args(num_experts=4), "--num-experts"),
    (_args(multi_latent_attention=True), "--multi-latent-attention"),
    (_args(window_size=(8, 0)), "--window-size"),
    (_args(reset=False, mock_doc_lengths="fixed:length=8", mock_data=False), "only applies with --mock-data"),
    (_args(reset=False, mock_doc_lengths="gamma:k=1"), "--mock-doc-lengths"),
])
def test_what_cannot_run_names_the_flag_and_the_fix(with_te, args, says):
    assert says in packed_documents.refusal(args)


def test_what_can_run_is_not_refused(with_te):
    assert packed_documents.refusal(_args()) is None
    assert packed_documents.refusal(_args(reset=False, mock_doc_lengths="lognormal:median=48,sigma=1.0,min=8,max=1024")) is None
    assert packed_documents.refusal(_args(device="cuda", bf16=True, stages=1)) is None
    assert packed_documents.refusal(_args(layout="thd", stages=2)) is None  # the stages exchange [b*s, 1, h]
