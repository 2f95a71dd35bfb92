"""CPU mode trains with torch's optimizer kernels even where megatron-core found fused ones."""

import torch

from megatron.resihp.arguments import parse_args
from tests.cli_args import TINY_CPU_ARGS
from tests.one_rank_world import one_rank_world


def _cuda_only(*args, **kwargs):
    raise AssertionError("a CUDA-only optimizer kernel was called on CPU")


class _FusedAdam:
    def __init__(self, *args, **kwargs):
        raise AssertionError("megatron-core's fused Adam was built on CPU")


def test_cpu_training_uses_torch_adam_and_norms_where_fused_kernels_are_installed(monkeypatch):
    """As megatron-core sets itself up when Transformer Engine is installed: fused Adam, TE's
    multi-tensor applier. A CPU step must touch neither."""
    from megatron.core import optimizer as optimizer_package
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron.resihp.model_builder import build_training_objects

    monkeypatch.setattr(optimizer_package, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(optimizer_package, "Adam", _FusedAdam)
    for module in (clip_grads, optimizer):
        monkeypatch.setattr(module, "multi_tensor_applier", _cuda_only)
    args = parse_args([*TINY_CPU_ARGS, "--clip-grad", "1.0"])
    with one_rank_world("gloo"):
        objects = build_training_objects(args, (args.num_layers,))
        inner = objects.optimizer.chained_optimizers[0].optimizer if hasattr(
            objects.optimizer, "chained_optimizers") else objects.optimizer.optimizer
        assert type(inner) is torch.optim.AdamW
        for p in objects.model.parameters():
            p.main_grad = torch.ones_like(p)  # what DDP's buffers hold after a backward
        assert objects.optimizer.step()[0]  # step, grad norm (TE's l2 norm), clipping
    assert optimizer_package.USING_PYTORCH_OPTIMIZER is False  # CPU mode's change undone on exit
    assert clip_grads.multi_tensor_applier is _cuda_only
