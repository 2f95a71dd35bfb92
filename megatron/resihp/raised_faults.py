"""Injected errors of a rank's own (``raise:`` faults) inside Megatron-LM's training step.

Responsible for striking a ``raise:rank=R,at=I,during=P`` fault where it says: in the forward
pass of rank R's first micro-batch of iteration I (or later), in that micro-batch's backward pass
(from a gradient hook on its output, so autograd is mid-way when it raises), or as R's optimizer
step begins. The error is a ``RuntimeError`` whose text does not come from torch.distributed, as
a device error or a bug in one rank's model code would be; what the rank and its peers then do
is the recovery's business (``failure_origin``, ``FailStopRecovery``), not this module's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron.resihp.logging_utils import log_line
from resihp_ext.faults import FaultKind


class RaisedFaults:
    """The ``raise:`` faults of this process, struck by the loop's step.

    Args:
        faults: this rank's injected faults (any kind; only raises are struck here).
        events: the event log (an ``inject`` event is written as a fault strikes).
        me: this rank's name in log lines.
    """

    def __init__(self, faults, events, me: str):
        self.faults = [f for f in faults if f.kind is FaultKind.RAISE]
        self.events = events
        self.me = me

    def aimed(self, phase: str, iteration: int) -> bool:
        return any(f.during == phase and f.active(iteration) for f in self.faults)

    def strike(self, phase: str, iteration: int) -> None:
        """Raise the fault aimed at ``phase`` of ``iteration``, if any."""
        for fault in self.faults:
            if fault.during == phase and fault.active(iteration):
                self.events.emit("inject", iteration, fault=fault.spec())
                log_line(f" {self.me}: injecting {fault.spec()}")
                raise RuntimeError(f"injected {fault.spec()}: an error of this rank's own in its {phase} "
                                   f"of iteration {iteration}")

    def forward_step(self, forward_step_func: Callable, iteration: int) -> Callable:
        """``forward_step_func`` striking the faults aimed at the forward and backward passes of
        ``iteration`` (itself when none is)."""
        if not (self.aimed("forward", iteration) or self.aimed("backward", iteration)):
            return forward_step_func

        # functools.wraps keeps the signature Megatron's schedules inspect to call it.
        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            self.strike("forward", iteration)
            output, loss_func = forward_step_func(*args, **kwargs)
            if self.aimed("backward", iteration):
                output.register_hook(lambda grad: self.strike("backward", iteration))
            return output, loss_func

        return forward_step
