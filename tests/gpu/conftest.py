"""What the GPU tests share: a one-rank NCCL world with megatron's parallel state."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank NCCL world (TP = PP = 1); only for tests that already skip without CUDA."""
    from tests.one_rank_world import one_rank_world

    assert torch.cuda.is_available()
    with one_rank_world("nccl"):
        yield
