"""scripts/bench/thd_attention.py runs and its two attentions agree; skipped without a GPU and
Transformer Engine. (A module of its own: the benchmark makes its own one-rank world.)"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_thd_attention_benchmark_times_both_and_they_agree():
    """At a size that runs in seconds."""
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    from scripts.bench.thd_attention import main

    result = main(["--layers", "2", "--seq-length", "256", "--rounds", "2", "--json"])
    assert result["te_thd_ms"] > 0 and result["ours_ms"] > 0
    assert result["distinct_lengths_median"] >= 1
    assert result["max_abs_diff"] < 2e-2
