"""A one-process torch.distributed world with megatron's parallel state (TP = PP = 1), for tests
that build megatron-core modules in the test process itself."""

import contextlib
import socket

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


@contextlib.contextmanager
def one_rank_world(backend: str):
    """``gloo`` runs megatron-core on CPU (CPU mode on), ``nccl`` on the current GPU."""
    from megatron.resihp import cpu_mode

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    if backend == "gloo":
        cpu_mode.enable()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if backend == "gloo":
            cpu_mode.disable()
        if created:
            dist.destroy_process_group()
