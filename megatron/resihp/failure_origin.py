"""Whether an error a rank caught in training came from a failed peer or from the rank itself.

Responsible for telling the two apart, because they call for opposite answers. A peer's failure
(a dead or stopped process, a broken connection) surfaces as an error of a collective on every
rank that shares one with it; each of those ranks is healthy and recovers in place. An error of
the rank's own (a device error, an assertion in its model code, running out of memory) leaves its
peers blocked in their next collective with it; the rank is the failure, and the fastest way for
the others to go on is for it to leave as a dead rank would, so that the heartbeats name it. A
rank that instead waited for some peer to be named would wait in vain, and every rank would give
up together.

An error is a peer's when torch.distributed raised it (its ``DistError`` types: NCCL's errors,
the store's), when gloo or c10d raised it (gloo's errors are plain ``RuntimeError``s whose text
starts with the bracketed source location that raised them), or when this package raised it on
learning that a peer failed (``PeerFailed``), anywhere along the chain of ``raise ... from``.
"""

from __future__ import annotations

import torch.distributed as dist


class PeerFailed(RuntimeError):
    """A peer failed while this rank waited on it (the heartbeats named it, or a change it took part
    in was abandoned)."""


def _raised_by_communication(error: BaseException) -> bool:
    if isinstance(error, (PeerFailed, dist.DistError)):
        return True
    text = str(error)
    source = text[1:text.find("]")] if text.startswith("[") and "]" in text else ""
    return "gloo" in source or "c10d" in source


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, came from communication with peers."""
    seen = set()
    while error is not None and id(error) not in seen:
        if _raised_by_communication(error):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False
