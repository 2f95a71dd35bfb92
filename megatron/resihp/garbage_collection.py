"""Python garbage collection kept out of timed work, and in step across ranks.

CPython's cyclic collector starts whenever allocations cross a threshold, so each rank pauses at
its own moment, inside whatever op is running. A full collection walks every live object; after
megatron-core and torch are imported that took 0.4-0.6 s of CPU per rank on this project's CPU
runs, once in the first two iterations, at a different moment on every rank. Inside a timed op
the pause reads as a slow device to the detector, and in a TP group or pipeline one rank's pause
stalls the others.

Two measures:

* ``settle()``: one full collection, on every rank at the same point outside any op: before
  training starts, and after an adaptation once the old model and optimizer are dropped (so
  their reference cycles go too). CPython starts its next full
  collection only once the objects that survived into the oldest generation since the last one
  reach a quarter of those it kept, so after a settle steady training rarely sees one. (Freezing
  the survivors with ``gc.freeze`` would make every later pause short, but a model or optimizer
  dropped by an adaptation would then never be collected if its objects form cycles.)
* ``--manual-gc`` (Megatron-LM's flag): automatic collection off; ``--manual-gc-interval N``
  collects every N iterations between iterations, on every rank at the same iteration (0: never).
"""

from __future__ import annotations

import gc
import time


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


def settle() -> None:
    """A full collection now, so the collector has no reason to start one soon."""
    gc.collect()


def start(args) -> None:
    """Before the first iteration."""
    settle()
    if args.manual_gc:
        gc.disable()


def after_iteration(args, iteration: int) -> None:
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()


def finish(args) -> None:
    """After training: the process may go on (tests call ``pretrain`` in-process)."""
    if args.manual_gc:
        gc.enable()
