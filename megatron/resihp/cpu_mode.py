"""CPU mode: run megatron-core on CPU processes over gloo.

megatron-core assumes CUDA in a handful of places (current device, synchronize, the CUDA RNG
tracker, literal ``device="cuda"`` tensors in the schedule, the optimizer and gradient clipping,
``torch.cuda.FloatTensor`` type checks). ``enable()`` maps each of them onto the CPU, once per
process, and ``disable()`` undoes every change. It is a supported mode for development and CI, in
fp32, bf16 or fp16, with Transformer Engine installed or not; its limits: no TE layers, no sequence
parallelism, no distributed optimizer.

Megatron-LM's own training loop (megatron-core 0.19's ``megatron.training``) needs more than this:
``cpu_training.enable()`` enables this module and adds the rest, and its ``disable()`` undoes both.

This module must never change numerics: every replacement computes what the CUDA original does.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any, Callable

import torch

_CPU = torch.device("cpu")
# Modules whose literal device="cuda" tensors are rewritten through a proxy for their `torch` name.
_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

_undo: list[Callable[[], None]] = []


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # an int device index means a CUDA ordinal in megatron-core


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside one megatron-core module and sends CUDA tensors to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))

    @staticmethod
    def _wrap(fn: Callable) -> Callable:
        def factory(*args, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _HostStream:
    """The one stream of a CPU process: work runs in program order, so every wait is already met.

    Why: megatron-core 0.19 asks for the current stream before each gradient reduction (to wait on
    CUDA-graph replays) and in its overlap paths; a CUDA build of torch without a driver raises there.
    """

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _set(owner: Any, name: str, value: Any) -> None:
    had = hasattr(owner, name)
    old = getattr(owner, name, None)
    setattr(owner, name, value)
    _undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))


def _get_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [(p.decoupled_grad if use_decoupled_grad else p.grad) for p in parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            if g is not None:
                g.mul_(clip_coeff)


def _with_cuda_type_names(init: Callable) -> Callable:
    """``init`` run while ``Tensor.type()`` names CPU tensors as their CUDA counterparts.

    Why: the mixed-precision optimizer sorts parameters into half and fp32 groups by comparing
    ``param.type()`` with ``'torch.cuda.BFloat16Tensor'`` and friends, and rejects anything else.
    """
    original = torch.Tensor.type

    def cuda_named(tensor, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and tensor.device.type == "cpu":
            name = original(tensor)  # already CUDA-named under cpu_training's function mode
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(tensor, dtype, non_blocking, **kwargs)

    def wrapped(self, *args, **kwargs):
        torch.Tensor.type = cuda_named
        try:
            return init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapped


def _use_torch_optimizer_kernels() -> None:
    """With Transformer Engine or Apex installed, megatron-core takes their fused Adam and
    multi-tensor kernels, which read CUDA memory only (given CPU tensors, TE's fault with an
    illegal memory access); on CPU it gets the torch implementations it falls back to without them."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    _set(importlib.import_module("megatron.core.optimizer"), "USING_PYTORCH_OPTIMIZER", True)
    for module in (clip_grads, optimizer):
        _set(module, "multi_tensor_applier", utils.local_multi_tensor_applier)
        _set(module, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    _set(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)


def enable() -> None:
    """Map megatron-core's CUDA-only calls onto the CPU (idempotent)."""
    if _undo:
        return
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import random as tp_random

    _set(torch.cuda, "current_device", lambda: _CPU)
    _set(torch.cuda, "synchronize", lambda device=None: None)
    _set(torch.cuda, "current_stream", lambda device=None: _HOST_STREAM)
    _set(torch.cuda, "default_stream", lambda device=None: _HOST_STREAM)
    _set(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    # e.g. the shared embedding all-reduce moves weights with `.cuda()` before reducing them.
    _set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    _set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    # The tracker seeds a private state, then restores the caller's; on CPU the tracked state is
    # the CPU generator's, so seeding it for real keeps TP ranks' dropout streams distinct.
    _set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    _set(tp_random, "_get_cuda_rng_state", _get_rng_state)
    _set(tp_random, "_set_cuda_rng_state", _set_rng_state)
    proxy = _CpuTorch()
    for module_name in _DEVICE_LITERAL_MODULES:
        _set(importlib.import_module(module_name), "torch", proxy)
    # The original asserts grads are torch.cuda.FloatTensor before scaling them.
    _set(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32)
    _set(optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32)
    half_optimizer = optimizer.Float16OptimizerWithFloat16Params
    _set(half_optimizer, "__init__", _with_cuda_type_names(half_optimizer.__init__))
    _use_torch_optimizer_kernels()
    # fork() compares CPU RNG state before/after and warns on every dropout call; on CPU the
    # tracked state *is* the CPU state, so the warning is expected and would flood the log.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def disable() -> None:
    """Undo ``enable()``."""
    while _undo:
        _undo.pop()()


def is_enabled() -> bool:
    return bool(_undo)


