"""A stand-in for ``torch.cuda.Event(enable_timing=True)`` where there is no GPU: it fires when
recorded, on the host's clock, and counts the waits on it. Lets tests check how the op recorder
handles events (when it records, waits and reads them) without a device."""

import time


class HostClockEvent:
    waits = 0  # calls of ``synchronize`` on any instance since the last reset

    def __init__(self):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        HostClockEvent.waits += 1

    def elapsed_time(self, later: "HostClockEvent") -> float:
        """Milliseconds from this event to ``later``, as torch.cuda.Event reports them."""
        return (later.at - self.at) * 1e3
