"""The launch's layers per stage on Megatron-LM's loop are where megatron-core places them from the flags, and a
stage it leaves without transformer layers is refused before a resilient job starts."""

from __future__ import annotations

import os
import sys

import pytest

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

JOB = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "2",
       "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
       "--pipeline-model-parallel-size", "2", "--eval-interval", "2"]


@pytest.fixture(autouse=True)
def _environment_kept():
    """Megatron's argument checks set attention-backend variables (``NVTE_*``) in the process
    environment; left there, every job launched later in the session would inherit them."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def _validated(monkeypatch, *extra: str):
    """Megatron's arguments for ``JOB`` + ``extra`` as its own parser and checks make them (4 ranks)."""
    from megatron.resihp import cpu_training
    from megatron.resihp.gpt_pretrain import ARGS_DEFAULTS, add_device_args
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_resilient.py", *cpu_training.implied_flags(), *JOB, *extra])
    return validate_args(parse_args(extra_args_provider=add_device_args), ARGS_DEFAULTS)


@pytest.mark.parametrize("extra, split", [
    ([], (2, 2)),
    (["--decoder-first-pipeline-num-layers", "1"], (1, 3)),
    (["--decoder-last-pipeline-num-layers", "1"], (3, 1)),
    (["--pipeline-model-parallel-layout", "Et|tttL"], (1, 3)),
    (["--num-layers", "3", "--account-for-embedding-in-pipeline-split"], (1, 2)),
    (["--num-layers", "3", "--account-for-loss-in-pipeline-split"], (2, 1)),
], ids=["even", "first-1", "last-1", "layout", "embedding-counted", "loss-counted"])
def test_the_launch_split_is_where_megatron_core_places_the_layers(monkeypatch, extra, split):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.resihp.megatron_loop_stages import launch_split, split_config
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = _validated(monkeypatch, *extra)
    assert launch_split(args) == split
    if "--pipeline-model-parallel-layout" not in extra:  # a layout's offsets read this rank's groups
        assert get_transformer_layer_offset(core_transformer_config_from_args(args), pp_rank=1) == split[0]
    # The launch's split is built from the flags, as stock Megatron-LM builds it; another from a layout of its own.
    assert split_config(args, split) is None
    moved = (split[0] + 1, split[1] - 1)
    stages = split_config(args, moved).pipeline_model_parallel_layout.layout
    assert tuple(stage[0].count(LayerType.decoder) for stage in stages) == moved


def test_a_stage_without_transformer_layers_is_refused_with_resilience(monkeypatch):
    from megatron.resihp.megatron_loop_stages import launch_split
    from megatron.resihp.megatron_loop_support import unsupported_flags
    from resihp_ext.config import ResiHPConfig

    args = _validated(monkeypatch, "--pipeline-model-parallel-layout", "E|ttttL")
    found = unsupported_flags(args, ResiHPConfig(enable=True), launch_split(args))
    assert len(found) == 1 and "a pipeline stage without transformer layers" in found[0] and "[0, 4]" in found[0]
    uneven = _validated(monkeypatch, "--decoder-first-pipeline-num-layers", "1")
    assert unsupported_flags(uneven, ResiHPConfig(enable=True), launch_split(uneven)) == []


@pytest.mark.parametrize("extra, split, layout_of", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], (2, 2), (0, 2, 1, 3)),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], (4, 4), (0, 1, 4, 5, 2, 3, 6, 7)),
    ([], (2, 2), None),
], ids=["vp-1-layer", "vp-2-layers", "not-interleaved"])
def test_under_the_interleaved_schedule_a_stage_holds_its_chunks_layers_and_the_layout_numbers_them_in_a_row(
        monkeypatch, extra, split, layout_of):
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.resihp.megatron_loop_stages import launch_split, layout_layer_of
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = _validated(monkeypatch, *extra)
    assert launch_split(args) == split
    assert layout_layer_of(args) == layout_of
    if layout_of is not None:
        # Stage 0's second chunk starts where megatron-core puts it, and the Layout counts it right after the first.
        second = get_transformer_layer_offset(core_transformer_config_from_args(args), vp_stage=1, pp_rank=0)
        assert layout_of[second] == split[0] // 2


def test_replicas_take_splits_of_their_own_unless_the_distributed_optimizer_pairs_their_buffers(monkeypatch):
    from megatron.resihp.megatron_loop_stages import own_splits_refused

    plain = _validated(monkeypatch)
    assert own_splits_refused(plain) is None
    # Set on the parsed arguments: Megatron's own checks of these flags ask a CUDA driver.
    plain.sequence_parallel = plain.overlap_grad_reduce = True
    assert own_splits_refused(plain) is None
    assert "--use-distributed-optimizer" in own_splits_refused(_validated(monkeypatch, "--use-distributed-optimizer"))


def test_the_layer_wise_sync_sums_the_norm_gradients_tp_ranks_hold_parts_of():
    from types import SimpleNamespace

    import torch

    from megatron.resihp.layer_sync import ParamSlot, tp_partial

    def slot(name, **attrs):
        param = torch.nn.Parameter(torch.zeros(2))
        for key, value in attrs.items():
            setattr(param, key, value)
        return ParamSlot(name, ("layer", 0), None, param)

    norm = slot("decoder.layers.0.input_layernorm.weight", sequence_parallel=True)
    assert tp_partial(norm, SimpleNamespace(sequence_parallel=True, qk_layernorm=False))
    assert not tp_partial(norm, SimpleNamespace(sequence_parallel=False, qk_layernorm=False))
    q_norm = slot("decoder.layers.0.self_attention.q_layernorm.weight")
    assert tp_partial(q_norm, SimpleNamespace(sequence_parallel=False, qk_layernorm=True))
    averaged = slot("decoder.layers.0.input_layernorm.weight", sequence_parallel=True,
                    average_gradients_across_tp_domain=True)
    assert not tp_partial(averaged, SimpleNamespace(sequence_parallel=True, qk_layernorm=False))
    bias = slot("decoder.layers.0.self_attention.linear_proj.bias")
    assert not tp_partial(bias, SimpleNamespace(sequence_parallel=True, qk_layernorm=True))
