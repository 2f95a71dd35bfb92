"""Naming the rank the others wait for: a hang inside a rank's own code, seen in seconds.

Responsible for two things the heartbeat watchdog (``heartbeat.HeartbeatMonitor``) uses:

* ``main_thread_state``: what this process's training thread is doing, read from its Python stack
  on the watchdog thread: ``waiting`` inside a collective or a pipeline transfer (torch.distributed,
  megatron-core's p2p communication), ``io`` while a checkpoint is written or read (which can take
  minutes on one rank while the others wait in the save's barrier), else ``working``. Each rank
  publishes its own state with its heartbeat;
* ``judge_blocking``: a rank that has been ``working`` without progress for a while, while another
  rank has been ``waiting`` as long, holds the job up: it is hung. Before, only progress was read,
  and while every rank stood still nobody could be named until the waiting ranks' collectives
  timed out and they reached their recovery code: twice the collective timeout, 60 s by default.

How long is "a while" follows the job: ``hang_iters`` times the rank's own median iteration, and at
least ``floor_s`` (a few heartbeat timeouts), so that a legitimately long step is never named, and
only once a few iterations of this world have been timed (the first iterations of a world warm up:
communicators, allocators, compilation). A rank stuck in C code that holds the GIL keeps the state
its watchdog last published, and is named only by the progress rule, as before.
"""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Mapping

WAITING, IO, WORKING = "waiting", "io", "working"

# Where a training thread waits for its peers: torch.distributed's calls, and megatron-core's
# pipeline transfers, which wait on their requests in their own frames. Only the innermost frames
# count: a launcher's wrapper around the whole script (torch.distributed.elastic's ``record``) is
# in torch.distributed too.
_WAITING_IN = ("/torch/distributed/", "/megatron/core/pipeline_parallel/p2p_communication.py")
_NOT_WAITING_IN = ("/torch/distributed/elastic/",)
_INNERMOST = 12
# Where it reads or writes a checkpoint.
_IO_IN = ("/megatron/training/checkpointing.py", "/megatron/core/dist_checkpointing/", "/torch/serialization.py",
          "/megatron/resihp/checkpointing.py", "/megatron/resihp/resilient_save.py")
# Iterations of a world timed before its ranks may be named this way.
MIN_TIMED_ITERATIONS = 3


def main_thread_state() -> str:
    """``WAITING``, ``IO`` or ``WORKING``: where the main thread's Python stack is now."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    state, depth = WORKING, 0
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if depth < _INNERMOST and any(m in path for m in _WAITING_IN) and not any(m in path for m in _NOT_WAITING_IN):
            return WAITING
        if any(marker in path for marker in _IO_IN):
            state = IO  # a collective inside a save (its barrier) is still a wait
        frame, depth = frame.f_back, depth + 1
    return state


def blocking_after_s(iteration_s: list[float], hang_iters: float, floor_s: float) -> float | None:
    """How long a rank may work without progress while others wait: ``hang_iters`` times the median
    of ``iteration_s`` (this world's iteration times so far), at least ``floor_s``; None while fewer
    than ``MIN_TIMED_ITERATIONS`` iterations were timed, or with ``hang_iters`` 0 (off)."""
    if hang_iters <= 0 or len(iteration_s) < MIN_TIMED_ITERATIONS:
        return None
    return max(floor_s, hang_iters * statistics.median(iteration_s))


def judge_blocking(now: float, progress_since: Mapping[int, float], states: Mapping[int, tuple[str, float]],
                   after_s: float) -> frozenset[int]:
    """Ranks holding the others up.

    Args:
        now: current time, on the clock of the times below.
        progress_since: rank -> when its progress last changed, for ranks still training (not
            dead, exited or recovering).
        states: rank -> (its state, since when it has been in that state without a break).
        after_s: how long (``blocking_after_s``).

    Returns:
        The ranks that have been ``working`` without progress for ``after_s`` while some other rank
        has been ``waiting`` for ``after_s``; empty when nobody waits that long.
    """
    def held(rank: int, state: str) -> bool:
        current, since = states.get(rank, (None, now))
        return current == state and now - since >= after_s

    if not any(held(r, WAITING) for r in progress_since):
        return frozenset()
    return frozenset(r for r, since in progress_since.items() if now - since >= after_s and held(r, WORKING))
