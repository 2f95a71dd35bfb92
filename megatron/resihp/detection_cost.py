"""What live detection costs, measured by running it on alternate iterations only.

``RESIHP_ALTERNATE_DETECTION=PERIOD:PHASE``: the op timing hooks and the detection step run only
on iterations ``i`` with ``i % PERIOD == PHASE``, and each iteration event carries ``detecting``,
``step_s`` (the iteration's time including detection), ``probe_rounds`` (probe rounds its detection
step ran), and over the same span ``cpu_s`` (the process's CPU time), ``gc_s`` (the cyclic
collector's pauses) and ``gc_full`` (its full collections), which tell host work and collections
from waiting on the device. Two runs of different phases time iterations both ways
(``scripts/bench/live_detection.py``).
"""

from __future__ import annotations

import gc
import os
import time

from megatron.resihp.schedules import install_hooks, uninstall_hooks

VARIABLE = "RESIHP_ALTERNATE_DETECTION"


class PauseClock:
    """Seconds the cyclic collector has paused this process, and its full collections, since the
    clock was made (``gc.callbacks``). For measurements that must tell a collection from the work
    around it; ``stop()`` removes the callback."""

    def __init__(self) -> None:
        self.paused_s, self.full_collections = 0.0, 0
        self._began = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.paused_s += time.perf_counter() - self._began
        self.full_collections += info["generation"] == 2

    def read(self) -> tuple[float, int]:
        """``(paused seconds, full collections)`` so far."""
        return self.paused_s, self.full_collections

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


def period_and_phase() -> tuple[int, int] | None:
    """``(period, phase)`` from the environment, None when unset; ValueError naming the variable
    and its form for a bad value."""
    value = os.environ.get(VARIABLE)
    if not value:
        return None
    period, _, phase = value.partition(":")
    if period.isdigit() and phase.isdigit() and 0 <= int(phase) < int(period):
        return int(period), int(phase)
    raise ValueError(f"{VARIABLE} must be PERIOD:PHASE with 0 <= PHASE < PERIOD (4:0 detects on iterations 4, 8, "
                     f"...), got {value!r}")


class AlternateDetection:
    """Detection on alternate iterations, and each iteration's measurements."""

    def __init__(self, period: int, phase: int) -> None:
        self.period, self.phase = period, phase
        self.detecting = True
        self._pauses = PauseClock()
        self._start = (0.0, 0.0, (0.0, 0))

    @classmethod
    def from_environment(cls) -> "AlternateDetection | None":
        found = period_and_phase()
        return None if found is None else cls(*found)

    def begin(self, iteration: int) -> bool:
        """Iteration ``iteration`` starts: whether it detects (its op hooks are installed only then)."""
        self.detecting = iteration % self.period == self.phase
        (install_hooks if self.detecting else uninstall_hooks)()
        self._start = (time.perf_counter(), time.process_time(), self._pauses.read())
        return self.detecting

    def measured(self, probe_rounds: int) -> dict:
        """The iteration event's fields since ``begin``; ``probe_rounds``: those its detection ran."""
        start_s, start_cpu_s, (paused_s, full) = self._start
        now_paused_s, now_full = self._pauses.read()
        return {"detecting": self.detecting, "step_s": time.perf_counter() - start_s,
                "cpu_s": time.process_time() - start_cpu_s, "gc_s": now_paused_s - paused_s,
                "gc_full": now_full - full, "probe_rounds": probe_rounds if self.detecting else 0}
