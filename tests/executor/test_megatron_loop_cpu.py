"""CPU mode for Megatron-LM's training package and the TE-less fixes: what they map, and that they undo."""

from __future__ import annotations

import pytest
import torch

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="the patches are checked against megatron-core 0.19.2 only")


def test_cpu_training_maps_cuda_onto_the_cpu_and_undoes_every_change():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.resihp import cpu_mode, cpu_training
    from megatron.training import training

    before = (torch.cuda.current_device, torch.cuda.Event, training.initialize_megatron,
              WrappedTorchNorm.__dict__["__new__"], DistributedOptimizer.state_dict, torch.Tensor.cuda)
    cpu_training.enable()
    try:
        assert cpu_mode.is_enabled()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu" and torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert end.elapsed_time(start) <= 0.0 <= start.elapsed_time(end)
        assert torch.cuda.get_device_properties(0).major == 9
    finally:
        cpu_training.disable()
    after = (torch.cuda.current_device, torch.cuda.Event, training.initialize_megatron,
             WrappedTorchNorm.__dict__["__new__"], DistributedOptimizer.state_dict, torch.Tensor.cuda)
    assert after == before and not cpu_mode.is_enabled() and not cpu_training.is_enabled()
    assert torch.ones(2).type() == "torch.FloatTensor"


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_torch_norms_take_sequence_parallel_and_layernorm_1p(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.resihp import training_compat

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, normalization=normalization,
                               layernorm_zero_centered_gamma=True)
    config.sequence_parallel = True  # set after validation: it asks for TP > 1, which needs a group
    training_compat.install()
    try:
        norm = WrappedTorchNorm(config, 8, eps=1e-5)
    finally:
        training_compat.uninstall()
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert torch.count_nonzero(norm.weight) == 0  # gamma = 1 + weight starts at 1
    x = torch.randn(3, 8)
    plain = torch.nn.LayerNorm(8, eps=1e-5) if normalization == "LayerNorm" else torch.nn.RMSNorm(8, eps=1e-5)
    torch.testing.assert_close(norm(x), plain(x))
    with pytest.raises(AssertionError, match="not supported by torch"):  # stock, once uninstalled
        WrappedTorchNorm(config, 8)


def test_the_dataset_helpers_are_built_only_where_a_makefile_ships():
    """The wheel ships the compiled helper and no Makefile: stock Megatron's start-up ``make`` fails
    there and the job exits, on a GPU as on a CPU."""
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (what Megatron imports instead)
    from megatron.core.datasets import utils as dataset_utils
    from megatron.resihp import training_compat

    training_compat.install()
    try:
        dataset_utils.compile_helpers()
    finally:
        training_compat.uninstall()
    with pytest.raises((SystemExit, FileNotFoundError)):  # stock, once uninstalled (no make: not found)
        dataset_utils.compile_helpers()


def test_a_gpu_job_without_apex_is_told_to_turn_gradient_accumulation_fusion_off(capsys):
    import argparse

    from megatron.resihp.gpt_pretrain import has_apex_wgrad_fusion, refuse_missing_flags

    if has_apex_wgrad_fusion():
        pytest.skip("apex's fused_weight_gradient_mlp_cuda is installed here")
    job = dict(eval_interval=10, full_validation=False, skip_train=False, device="cuda")
    with pytest.raises(SystemExit) as stop:
        refuse_missing_flags(argparse.Namespace(**job, gradient_accumulation_fusion=True))
    assert stop.value.code == 2
    assert "error: --no-gradient-accumulation-fusion:" in capsys.readouterr().err
    refuse_missing_flags(argparse.Namespace(**job, gradient_accumulation_fusion=False))


def test_rampup_batch_size_is_refused_before_anything_starts(capsys):
    from megatron.resihp.gpt_pretrain import refuse_ignored_flags

    with pytest.raises(SystemExit) as stop:
        refuse_ignored_flags(["--num-layers", "2", "--rampup-batch-size", "16", "16", "5859375"])
    assert stop.value.code == 2
    assert "--step-batch-size-schedule" in capsys.readouterr().err
    refuse_ignored_flags(["--step-batch-size-schedule", "0:8 64:16"])
