"""Telling a failed peer's error from a rank's own: the first is recovered from in place, the second
makes the rank leave (``FailStopRecovery._leave_failed``)."""

import torch
import torch.distributed as dist

from megatron.resihp.failure_origin import PeerFailed, is_peer_failure
from megatron.resihp.reconfigure import ChangeFailed

# As torch 2.13's gloo raises them when a peer dies or stops answering.
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
              "[127.0.0.1]:43957. This is typically caused by a remote worker hanging or bugs in the application")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "5000ms for recv operation to complete")


def test_errors_of_communication_with_peers_are_a_peers_failure():
    assert is_peer_failure(RuntimeError(GLOO_RESET))
    assert is_peer_failure(RuntimeError(GLOO_TIMEOUT))
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_peer_failure(PeerFailed("launch rank 3 failed before the world formed"))
    assert is_peer_failure(ChangeFailed("a member failed", run=None))


def test_an_error_raised_from_a_peers_failure_is_one_too():
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as cause:
            raise RuntimeError("the gradient all-reduce did not finish") from cause
    except RuntimeError as error:
        assert is_peer_failure(error)


def test_a_ranks_own_errors_are_not():
    assert not is_peer_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_peer_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_peer_failure(AssertionError("shape mismatch"))
    assert not is_peer_failure(RuntimeError("[in brackets] but from no communication library"))
    # An own error raised while another was being handled is still the rank's own.
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError:
            raise ValueError("bad batch")
    except ValueError as error:
        assert not is_peer_failure(error)
