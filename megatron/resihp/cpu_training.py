"""CPU mode for Megatron-LM's training package: run ``megatron.training.pretrain()`` on CPU processes.

Responsible for everything beyond ``cpu_mode`` (which maps megatron-core's own CUDA-only calls) that
Megatron-LM's training loop needs on a host without a GPU:

- a ``TorchFunctionMode`` that sends ``device="cuda"`` / ``device=<int>`` to the CPU, makes
  ``Tensor.cuda()`` and ``Tensor.pin_memory()`` identities, maps ``Tensor.to(cuda|int)`` to the CPU
  and makes ``Tensor.type()`` answer ``torch.cuda.*`` (about 150 call sites in the package build
  tensors on ``torch.cuda.current_device()``; gradient clipping and the optimizers branch on the
  type string);
- stand-ins for ``torch.cuda``'s runtime: ``current_device`` (0), no-op ``set_device``,
  ``empty_cache``, ``set_stream``, ``manual_seed_all`` (``torch.manual_seed`` calls it, and the CPU
  generator is already seeded), memory statistics (zero), an ``Event`` timed with ``perf_counter``
  (Megatron's timers read it), a ``Stream``, device properties of compute capability 9.0 (argument
  validation asks for one), and the CUDA profiler's start/stop (``--profile`` without the torch
  profiler) as no-ops: a CPU has no CUDA profiler to start;
- ``initialize_megatron(allow_no_cuda=True)`` with ``torch.cuda.device_count()`` answering 1 while
  it runs (otherwise it skips ``initialize_model_parallel`` and the tensor-parallel RNG tracker);
- data iterators made without moving the default generator (``_keeping_rng_state``), so that a
  resumed run's dropout masks are the uninterrupted run's, as on a GPU;
- no JIT fusion warm-up (``set_jit_fusion_options``: 13.7 s per rank on a CPU, and nothing is
  fused there);
- ``--async-save``'s persistent writer forked from the rank (``_forked_writer``), not started by a
  fork server: a fresh interpreter has none of these stand-ins;
- ``--async-save``'s tensors copied as the writer takes them (``preload_tensors_copied``): the copy a
  GPU's device-to-host transfer makes is the save's snapshot, and a CPU has none to make.

Checked against megatron-core 0.19.2 only: importing this module with another version raises, since
every patch names a function of that release. ``enable()`` is idempotent; ``disable()`` undoes every
change, ``cpu_mode``'s included. This module must never change numerics.
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
from megatron.core import package_info
from torch.overrides import TorchFunctionMode

from megatron.resihp import cpu_mode

CHECKED_MCORE = "0.19.2"
# A wheel installed inside a git checkout reports its version with that checkout's commit appended
# ("0.19.2+abc1234"): the release is what the patches were checked against.
if package_info.__version__.split("+")[0] != CHECKED_MCORE:
    raise ImportError(
        f"megatron.resihp.cpu_training patches megatron-core {CHECKED_MCORE}'s training package, but "
        f"megatron-core {package_info.__version__} is installed; install megatron-core=={CHECKED_MCORE}"
    )

_CPU = torch.device("cpu")
_undo: list[Callable[[], None]] = []
_mode: TorchFunctionMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int names a CUDA ordinal


class _CudaOnCpu(TorchFunctionMode):
    """Every torch call of the process, with CUDA placements answered by the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _TimedEvent:
    """``torch.cuda.Event`` on a host: work runs in program order, so recording is reading the clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        self._t = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end: "_TimedEvent") -> float:
        return (end._t - self._t) * 1000.0

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream(cpu_mode._HostStream):
    """``torch.cuda.Stream()``: the host's one stream (see ``cpu_mode._HostStream``)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass


def _properties(device: Any = None) -> SimpleNamespace:
    # Compute capability 9.0: validate_args requires >= 8 for several TP>1 paths; nothing runs a kernel.
    return SimpleNamespace(name="cpu", major=9, minor=0, total_memory=0, multi_processor_count=1)


def _set(owner: Any, name: str, value: Any) -> None:
    had = hasattr(owner, name)
    old = getattr(owner, name, None)
    setattr(owner, name, value)
    _undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))


@contextlib.contextmanager
def _one_device():
    """``torch.cuda.device_count()`` answers 1 inside: initialize_megatron then builds the model-parallel
    groups and seeds the tensor-parallel RNG tracker, which it skips on a host without devices."""
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = original


def _initialize_on_cpu(initialize: Callable) -> Callable:
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        with _one_device():
            return initialize(*args, **kwargs)

    return initialize_megatron


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "current_device", lambda: 0)
    for name in ("set_device", "empty_cache", "set_stream", "manual_seed_all", "reset_peak_memory_stats",
                 "reset_max_memory_allocated"):
        _set(cuda, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        _set(cuda, name, lambda device=None: 0)
    _set(cuda, "memory_stats", lambda device=None: {})
    _set(cuda, "mem_get_info", lambda device=None: (0, 0))
    _set(cuda, "Event", _TimedEvent)
    _set(cuda, "Stream", _HostStream)
    _set(cuda, "get_device_properties", _properties)
    _set(cuda, "get_device_capability", lambda device=None: (9, 0))
    _set(cuda, "get_device_name", lambda device=None: "cpu")
    profiler = SimpleNamespace(cudaProfilerStart=lambda: 0, cudaProfilerStop=lambda: 0)
    _set(cuda, "cudart", lambda: profiler)
    _set(cuda, "check_error", lambda result: None)


def _keeping_rng_state(build: Callable) -> Callable:
    """``build`` run without moving the default generator.

    Why: a DataLoader draws its workers' base seed from the default generator when its iterator is
    made. On a GPU that generator is not the one dropout draws from; on a CPU it is. A resumed run
    restores the RNG state first and makes its iterators after, so without this its dropout masks
    would be shifted against the uninterrupted run's.
    """

    def wrapped(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    return wrapped


def _patch_training_package() -> None:
    from megatron.training import initialize, training

    _set(training, "initialize_megatron", _initialize_on_cpu(initialize.initialize_megatron))
    _set(training, "build_train_valid_test_data_iterators",
         _keeping_rng_state(training.build_train_valid_test_data_iterators))
    _set(training, "set_jit_fusion_options", lambda *args, **kwargs: None)
    _set(initialize, "init_persistent_async_worker", _forked_writer(initialize.init_persistent_async_worker))
    _copy_preloaded_tensors()


_megatron_preload: Callable | None = None  # ``FileSystemWriterAsync.preload_tensors`` as megatron-core has it


def preload_tensors_copied(write_buckets, non_blocking: bool = True):
    """megatron-core's ``FileSystemWriterAsync.preload_tensors`` with every tensor copied.

    Why: the rank waits for its writer to preload a save's tensors and then trains on. On a GPU the
    preload's device-to-host copy is the save's snapshot; on a CPU ``tensor.to("cpu")`` returns the
    tensor itself, shared with the writer, which then wrote values the next steps had changed in
    place (a save of iteration 4 with some of step 5's Adam moments). Module-level, so that the
    request the writer receives names it."""
    return [(file_name, key, (data, [(item, tensor.clone()) for item, tensor in tensors]))
            for file_name, key, (data, tensors) in _megatron_preload(write_buckets, non_blocking)]


def _copy_preloaded_tensors() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    global _megatron_preload
    old = FileSystemWriterAsync.__dict__["preload_tensors"]  # the staticmethod itself, to put back as it was
    _megatron_preload = old.__func__
    FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors_copied)
    _undo.append(lambda: setattr(FileSystemWriterAsync, "preload_tensors", old))


def _forked_writer(start: Callable) -> Callable:
    """``init_persistent_async_worker`` with the writer process forked, not started by a fork server.

    Why: a fresh interpreter has none of these stand-ins, and the writer's first line divides the
    rank by ``torch.cuda.device_count()``, which is 0 on a host without a GPU; the save then waits
    for a writer that died. A forked writer inherits this mode, the device count answering 1 (as
    inside ``initialize_megatron``; a writer started again after a failure starts outside it)."""

    def init_persistent_async_worker(rank: int, mp_mode: str = "spawn"):
        with _one_device():
            return start(rank, "fork")

    return init_persistent_async_worker


def enable() -> None:
    """Put this process in CPU mode for Megatron-LM's training loop (idempotent).

    Enables ``cpu_mode`` first, then the torch.cuda stand-ins, the training-package patches, the
    compatibility fixes of ``training_compat`` and the device-mapping function mode.
    """
    global _mode
    if _undo:
        return
    from megatron.resihp import training_compat

    cpu_mode.enable()
    _undo.append(cpu_mode.disable)
    # validate_args asks for it with TP or CP > 1 (it orders kernels on a GPU's queues); a host has none.
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        _undo.append(lambda: os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None))
    _patch_torch_cuda()
    _patch_training_package()
    training_compat.install()
    _undo.append(training_compat.uninstall)
    _mode = _CudaOnCpu()
    _mode.__enter__()

    def leave() -> None:
        global _mode
        _mode.__exit__(None, None, None)
        _mode = None

    _undo.append(leave)


def disable() -> None:
    """Undo ``enable()``, in reverse order."""
    while _undo:
        _undo.pop()()


def is_enabled() -> bool:
    return bool(_undo)


def implied_flags() -> list[str]:
    """The Megatron flags a CPU job needs, which ``--device cpu`` puts before the user's own.

    gloo, since NCCL needs GPUs; no gradient-accumulation fusion, persistent layer norm, RoPE fusion or
    masked-softmax fusion, which are CUDA kernels (Megatron asserts without them); no bias fusions, which
    torch.compile would build for the CPU at ~14 s per rank; the local transformer implementation.

    Returns:
        The flags, in command-line form.
    """
    flags = ["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
             "--no-masked-softmax-fusion"]
    # TE's layers run CUDA kernels only: on a CPU the local implementation is the only one that runs.
    flags += ["--transformer-impl", "local"]
    return flags
