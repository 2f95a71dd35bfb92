"""The training test on CUDA (world size 1, NCCL); skipped on machines without a GPU."""

import pytest
import torch

from tests.dist.launch import check, iteration_losses, run_job, tiny_gpt_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_trains_on_cuda(tmp_path, precision):
    # Started by scripts/launch_local.py: its rank is forked from a server that imported torch and
    # megatron-core, so this also shows the fork left CUDA usable.
    args = tiny_gpt_on("cuda")
    log = tmp_path / "events.jsonl"
    check(run_job(1, [*args, *precision, "--train-iters", "20", "--resihp-event-log", str(log)]))
    losses = iteration_losses(log)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1]


# The weights drawn from the CPU's generator on both devices: a GPU's default initialisation draws
# from the CUDA generator, whose numbers for the same seed are not the CPU's (on a CPU alone, the
# two initialisations' first losses already differ by 0.4%).
SAME_WEIGHTS = ["--use-cpu-initialization"]


def _first_losses_by_device(tmp_path, extra=()) -> dict[str, list[float]]:
    """The losses of iterations 1-3 of the same job on CPU and on CUDA, without dropout."""
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3", *SAME_WEIGHTS]
    runs = {}
    for device in ("cpu", "cuda"):
        log = tmp_path / f"{device}.jsonl"
        args = tiny_gpt_on(device)
        check(run_job(1, [*args, *extra, *no_dropout, "--resihp-event-log", str(log)]))
        losses = iteration_losses(log)
        runs[device] = [losses[i] for i in (1, 2, 3)]
    return runs


def test_cuda_matches_cpu_losses(tmp_path):
    runs = _first_losses_by_device(tmp_path)
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3)


PACKED = ["--mock-doc-lengths", "lognormal:median=24,sigma=1.0,min=4,max=256", "--reset-attention-mask",
          "--reset-position-ids", "--eod-mask-loss"]


def test_packed_documents_attend_within_each_document_on_cuda(tmp_path):
    """Packed documents as [s, b] on CUDA (Transformer Engine's layers around our document attention
    when TE is installed) train to the same losses as on CPU, so attention stays within each
    document on both."""
    runs = _first_losses_by_device(tmp_path, [*PACKED, "--packed-seq-layout", "sbhd"])
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3)


def test_packed_documents_use_transformer_engines_thd_attention(tmp_path):
    """With Transformer Engine and bf16, packed documents go through TE's own attention in the THD
    layout (what --packed-seq-layout auto picks there) and train as the [s, b] layout with our
    document attention inside TE's layers does. (Which of the two attends within documents is
    checked kernel against kernel in test_thd_attention_cuda.py; early losses of a random model
    barely see attention.)"""
    import argparse

    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron.resihp import packed_documents

    spec = get_gpt_layer_with_transformer_engine_spec()
    chosen = argparse.Namespace(device="cuda", reset_attention_mask=True, packed_seq_layout="auto", bf16=True,
                                fp16=False, transformer_impl="transformer_engine")
    assert packed_documents.layout(chosen) == "thd"
    packed_documents.with_document_attention(argparse.Namespace(layer_specs=[spec]), chosen)
    assert spec.submodules.self_attention.submodules.core_attention is TEDotProductAttention
    args = tiny_gpt_on("cuda")
    losses = {}
    for layout in ("thd", "sbhd"):
        log = tmp_path / f"{layout}.jsonl"
        check(run_job(1, [*args, *PACKED, "--bf16", "--packed-seq-layout", layout, "--hidden-dropout", "0",
                          "--attention-dropout", "0", "--train-iters", "10", "--resihp-event-log", str(log)]))
        losses[layout] = [iteration_losses(log)[i] for i in range(1, 11)]
    assert losses["thd"][-1] < losses["thd"][0]
    assert losses["thd"] == pytest.approx(losses["sbhd"], rel=2e-2)
