"""Injected link slowdowns on live pipeline transfers.

Responsible for making ``link:src=S,dst=D,factor=F`` true in a running job: every pipeline
transfer rank S sends to rank D takes F times as long as on the healthy link. A transfer's healthy
time is its size times the link's seconds per byte, measured between S and D with the same p2p
probe that validation uses, at the iteration the fault starts; the sender then waits
``(F - 1)`` times that before handing the tensor over, as a link with 1/F of its bandwidth would.

The hook wraps the module-level p2p functions megatron-core's pipeline communicator calls by name
(``_p2p_ops``, ``_batched_p2p_ops``), so it sees every activation and gradient a rank sends to a
neighbour stage, whatever the schedule.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from megatron.core.pipeline_parallel import p2p_communication

_ORIGINAL: dict[str, Callable] = {}


class LinkDelays:
    """This rank's slowed outgoing links: destination rank -> (factor, healthy seconds per byte)."""

    def __init__(self) -> None:
        self.links: dict[int, tuple[float, float]] = {}

    def slow(self, dst: int, factor: float, seconds_per_byte: float) -> None:
        self.links[dst] = (factor, seconds_per_byte)
        _install()

    def clear(self) -> None:
        """Forget every slowed link (the world was re-formed: ranks mean other processes now)."""
        self.links.clear()

    def extra_s(self, dst: int, num_bytes: int) -> float:
        factor, per_byte = self.links.get(dst, (1.0, 0.0))
        return (factor - 1.0) * num_bytes * per_byte

    def delay(self, dst: int, num_bytes: int) -> None:
        extra = self.extra_s(dst, num_bytes)
        if extra > 0:
            time.sleep(extra)


LINKS = LinkDelays()


def _nbytes(tensor) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _delayed(original: Callable) -> Callable:
    @functools.wraps(original)
    def send_after_delay(**kwargs):
        if LINKS.links:
            LINKS.delay(kwargs["next_pipeline_rank"], _nbytes(kwargs.get("tensor_send_next")))
            LINKS.delay(kwargs["prev_pipeline_rank"], _nbytes(kwargs.get("tensor_send_prev")))
        return original(**kwargs)
    return send_after_delay


def _install() -> None:
    if _ORIGINAL:
        return
    for name in ("_p2p_ops", "_batched_p2p_ops"):
        original = getattr(p2p_communication, name)
        _ORIGINAL[name] = original
        setattr(p2p_communication, name, _delayed(original))
