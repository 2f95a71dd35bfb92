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


def _megatron_stage_layers(config, pp: int, vp: int) -> tuple[tuple[int, ...], ...]:
    """The model's layers megatron-core builds on each stage from ``config``, chunk by chunk."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = config.pipeline_model_parallel_layout  # megatron-core's functions read a layout for this rank's stage
    offset = get_transformer_layer_offset if layout is None else (lambda _, **at: layout.get_layer_offset(**at))
    count = get_num_layers_to_build if layout is None else (lambda _, **at: layout.get_num_layers_to_build(**at))
    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)  # a layout reads chunk 0 without it
    try:
        return tuple(tuple(layer for v in range(vp)
                           for first in [offset(config, vp_stage=v, pp_rank=p)]
                           for layer in range(first, first + count(config, vp_stage=v, pp_rank=p)))
                     for p in range(pp))
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(before)


@pytest.mark.parametrize("extra, chunks, moved", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], ((1, 1), (1, 1)), (1, 3)),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], ((2, 2), (2, 2)), (3, 5)),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], ((2, 2), (2, 2)), (6, 2)),
    (["--pipeline-model-parallel-layout", "Et|t|t|tL"], ((1, 1), (1, 1)), (3, 1)),
], ids=["vp-1-layer", "vp-2-layers", "vp-2-layers-back", "layout"])
def test_under_the_interleaved_schedule_megatron_core_builds_each_stage_the_layers_the_layout_says_it_holds(
        monkeypatch, extra, chunks, moved):
    # The Layout names a layer by its number in the whole model; under the interleaved schedule a
    # stage's chunks hold layers apart, and after a move megatron-core must build on each stage
    # exactly the layers the Layout's items (what state moves and gradients sum by) put there.
    from megatron.resihp.megatron_loop_stages import launch_chunks, launch_split, split_config
    from megatron.training.argument_utils import core_transformer_config_from_args
    from resihp_ext.layout import Layout, ModelSpec

    args = _validated(monkeypatch, *extra)
    assert launch_chunks(args) == chunks and launch_split(args) == tuple(map(sum, chunks))
    model = ModelSpec(num_layers=args.num_layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                      vocab_size=512, seq_length=64, micro_batch_size=2, launch_chunks=launch_chunks(args))
    vp = len(chunks[0])
    at_launch = _megatron_stage_layers(core_transformer_config_from_args(args), 2, vp)
    assert Layout.uniform(model, 1, 2, 1, launch_split(args)).held_layers(0) == at_launch
    assert at_launch[0] != tuple(range(len(at_launch[0])))  # the chunks hold layers apart
    after = _megatron_stage_layers(split_config(args, moved), 2, vp)
    assert tuple(map(len, after)) == moved
    assert Layout.uniform(model, 1, 2, 1, moved).held_layers(0) == after
    # Every layer but the fewest a move can shift stays on its stage.
    stayed = sum(len(set(a) & set(b)) for a, b in zip(at_launch, after))
    assert stayed == args.num_layers - abs(moved[0] - launch_split(args)[0])


def test_without_the_interleaved_schedule_there_are_no_chunks_to_size(monkeypatch):
    from megatron.resihp.megatron_loop_stages import launch_chunks

    assert launch_chunks(_validated(monkeypatch)) is None


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
