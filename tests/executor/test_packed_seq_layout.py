"""--packed-seq-layout resolves to the layout the job's attention can read documents in."""

import argparse
import importlib.util

import pytest

from megatron.resihp.arguments import _packed_seq_layout


def _args(layout="auto", device="cpu", reset=True, bf16=False, fp16=False):
    return argparse.Namespace(packed_seq_layout=layout, device=device, reset_attention_mask=reset, bf16=bf16, fp16=fp16)


@pytest.fixture
def with_te(monkeypatch):
    """Transformer Engine seen as installed (it cannot be installed on a machine without CUDA)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else find_spec(name, *a))


def test_auto_without_transformer_engine_is_sbhd():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    for device in ("cpu", "cuda"):
        assert _packed_seq_layout(_args(device=device, bf16=True)) == "sbhd"
    assert _packed_seq_layout(_args(layout="thd")) == "thd"  # our document attention reads it


def test_auto_picks_thd_where_transformer_engine_can_run_it(with_te):
    assert _packed_seq_layout(_args(device="cuda", bf16=True)) == "thd"
    assert _packed_seq_layout(_args(device="cuda", fp16=True)) == "thd"
    assert _packed_seq_layout(_args(device="cuda")) == "sbhd"  # fp32: TE has no THD kernel
    assert _packed_seq_layout(_args(device="cuda", bf16=True, reset=False)) == "sbhd"
    assert _packed_seq_layout(_args(device="cpu", bf16=True)) == "sbhd"
    assert _packed_seq_layout(_args(layout="sbhd", device="cuda", bf16=True)) == "sbhd"


def test_thd_that_cannot_run_names_the_flag_and_the_fix(with_te):
    with pytest.raises(ValueError, match="--packed-seq-layout thd needs --reset-attention-mask"):
        _packed_seq_layout(_args(layout="thd", reset=False))
    with pytest.raises(ValueError, match="needs --bf16 or --fp16.*--packed-seq-layout sbhd"):
        _packed_seq_layout(_args(layout="thd", device="cuda"))
