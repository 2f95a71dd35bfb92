"""Fixes that let megatron-core 0.19.2 train without Transformer Engine or apex, on any device.

Responsible for the gaps that every job without TE/apex meets (on a GPU as on a CPU), each a patch
of one megatron-core 0.19.2 function, installed by ``install()`` and undone by ``uninstall()``:

- **Torch norms** (``WrappedTorchNorm``) assert on ``--sequence-parallel``,
  ``--apply-layernorm-1p`` and the persistent-kernel setting. Here: with sequence parallelism the
  norm is built as usual and its parameters are marked ``sequence_parallel`` (each TP rank then
  normalises its own sequence shard, and ``finalize_model_grads`` all-reduces those parameters'
  gradients over the TP group, as it does for TE's norms); ``zero_centered_gamma`` (1p) is a norm
  whose weight starts at 0 and scales by ``1 + weight``; the persistent kernel is apex's way of
  computing the same function, so the torch norm stands for it.
- **The distributed optimizer with torch Adam** (``DistributedOptimizer``): ``state_dict()`` asserts
  on one Adam ``step`` where Adam has no state yet (the template a checkpoint load builds first), so
  it reports step 0 there; ``load_state_dict()`` hands every parameter the same ``step`` tensor,
  which torch Adam then increments once per parameter per step, so each parameter gets its own
  copy; ``_set_main_param_and_optimizer_states`` copies into leaf tensors that require grad outside
  ``no_grad``, which autograd rejects, so it runs under ``no_grad``, and it copies Adam's ``step``
  from the parameter state, which holds none in the ``torch`` format (``KeyError: 'step'``) and, in
  ``torch_dist``, the value the load template held before the checkpoint was read (the resumed run's
  Adam step went back to 0), so ``step`` is left to ``load_state_dict``, which restores it from the
  checkpoint's param groups.
- **The dataset helpers' build** (``compile_helpers``): rank 0 runs ``make`` in the package's
  ``datasets`` folder as it starts, and exits when that fails; the wheel ships the helper compiled
  and no Makefile, so every job from the wheel ended there. The build runs only where a Makefile is
  (a source checkout); otherwise the shipped helper is what Megatron imports.

Checked against megatron-core 0.19.2 only (importing this module with another version raises).
This module must never change what a run computes where megatron-core's own code path works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from megatron.core import package_info

CHECKED_MCORE = "0.19.2"
# A wheel installed inside a git checkout reports its version with that checkout's commit appended
# ("0.19.2+abc1234"): the release is what the patches were checked against.
if package_info.__version__.split("+")[0] != CHECKED_MCORE:
    raise ImportError(
        f"megatron.resihp.training_compat patches megatron-core {CHECKED_MCORE}, but megatron-core "
        f"{package_info.__version__} is installed; install megatron-core=={CHECKED_MCORE}"
    )

_undo: list[Callable[[], None]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    old = owner.__dict__[name]
    setattr(owner, name, value)
    _undo.append(lambda: setattr(owner, name, old))


class _ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm with ``--apply-layernorm-1p``: the weight is stored as ``gamma - 1`` (so weight decay
    pulls gamma toward 1), starting at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with ``--apply-layernorm-1p`` (see ``_ZeroCenteredLayerNorm``)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def _torch_norm(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
    """``WrappedTorchNorm.__new__`` for every configuration a TE norm accepts."""
    assert not config.memory_efficient_layer_norm, "memory_efficient_layer_norm needs apex's LayerNorm"
    kinds = {
        ("LayerNorm", False): torch.nn.LayerNorm,
        ("LayerNorm", True): _ZeroCenteredLayerNorm,
        ("RMSNorm", False): torch.nn.RMSNorm,
        ("RMSNorm", True): _ZeroCenteredRMSNorm,
    }
    key = (config.normalization, bool(config.layernorm_zero_centered_gamma))
    if key not in kinds:
        raise ValueError(f"--normalization {config.normalization} has no torch norm here; use LayerNorm or RMSNorm")
    norm = kinds[key](normalized_shape=hidden_size, eps=eps)
    if config.sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


def _state_dict_before_first_step(state_dict: Callable) -> Callable:
    from megatron.core.optimizer import distrib_optimizer

    def wrapped(self):
        if distrib_optimizer.HAVE_APEX_OR_TE or len(self.optimizer.state) > 0:
            return state_dict(self)
        inner = self.optimizer.state_dict()
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in out["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0  # Adam has not stepped yet
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return wrapped


def _own_step_per_parameter(load_state_dict: Callable) -> Callable:
    def wrapped(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return result

    return wrapped


def _set_states_keeping_step(method: Callable) -> Callable:
    def wrapped(self, model_param, tensors):
        # "step" is restored from the checkpoint's param_groups by load_state_dict; the parameter state
        # carries either none (torch format: KeyError) or the value the load template held before
        # the checkpoint was read (torch_dist: Adam's step back to 0).
        with torch.no_grad():
            return method(self, model_param, {**tensors, "step": None})

    return wrapped


def _build_where_a_makefile_is(compile_helpers: Callable, folder: Path) -> Callable:
    def wrapped():
        if (folder / "Makefile").exists():
            compile_helpers()

    return wrapped


def install() -> None:
    """Apply every fix (idempotent)."""
    if _undo:
        return
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _set(WrappedTorchNorm, "__new__", staticmethod(_torch_norm))
    _set(DistributedOptimizer, "state_dict", _state_dict_before_first_step(DistributedOptimizer.state_dict))
    _set(DistributedOptimizer, "load_state_dict", _own_step_per_parameter(DistributedOptimizer.load_state_dict))
    _set(DistributedOptimizer, "_set_main_param_and_optimizer_states",
         _set_states_keeping_step(DistributedOptimizer._set_main_param_and_optimizer_states))
    _set(dataset_utils, "compile_helpers",
         _build_where_a_makefile_is(dataset_utils.compile_helpers, Path(dataset_utils.__file__).parent))


def uninstall() -> None:
    """Undo ``install()``."""
    while _undo:
        _undo.pop()()
