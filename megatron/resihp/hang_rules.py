"""Which live ranks are hung: the rules the heartbeat watchdog (``heartbeat.HeartbeatMonitor``) applies.

Responsible for naming a rank that is alive (its heartbeat flows) but holds the job up:

* ``judge_progress``: its training progress stood still for the hang timeout while the job as a
  whole did not; a rank compiling a ``torch.compile`` graph (``compile_watch``) is working, not
  stalled, for up to the compile timeout, and its stall clock starts again when the compile ends;
* ``main_thread_state``: what this process's training thread is doing, read from its Python stack
  on the watchdog thread: ``waiting`` inside a collective or a pipeline transfer (torch.distributed,
  megatron-core's p2p communication), ``io`` while a checkpoint is written or read (which can take
  minutes on one rank while the others wait in the save's barrier), else ``working``; the watchdog
  publishes ``compiling`` instead of ``working`` while ``compile_watch`` says so. Each rank
  publishes its own state with its heartbeat;
* ``judge_blocking``: a rank that has been ``working`` without progress for a while, while another
  rank has been ``waiting`` as long, holds the job up: it is hung. With progress alone, while every
  rank stands still nobody can be named until the waiting ranks' collectives time out and they
  reach their recovery code: twice the collective timeout, 60 s by default.

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

WAITING, IO, WORKING, COMPILING = "waiting", "io", "working", "compiling"

# Where a training thread waits for its peers: torch.distributed's calls, and megatron-core's
# pipeline transfers, which wait on their requests in their own frames. Only the innermost frames
# count: a launcher's wrapper around the whole script (torch.distributed.elastic's ``record``) is
# in torch.distributed too.
_WAITING_IN = ("/torch/distributed/", "/megatron/core/pipeline_parallel/p2p_communication.py")
_NOT_WAITING_IN = ("/torch/distributed/elastic/",)
_INNERMOST = 12
# Where it reads or writes a checkpoint.
_IO_IN = ("/megatron/training/checkpointing.py", "/megatron/core/dist_checkpointing/", "/torch/serialization.py")
# Iterations of a world timed before its ranks may be named this way.
MIN_TIMED_ITERATIONS = 3


def judge_progress(now: float, progress: Mapping[int, tuple[int, float]], hang_timeout_s: float,
                   recovering: frozenset[int] = frozenset(), failure_seen_at: float | None = None,
                   failure_grace_s: float = 0.0, compiling: frozenset[int] = frozenset()) -> frozenset[int]:
    """Ranks whose training progress stopped while the job as a whole did not.

    A rank is *stalled* when its progress value has not changed for more than ``hang_timeout_s``.
    A stalled rank is hung when another rank is still advancing or recovering, or when it is
    behind the most advanced rank. When every rank stalled at the same progress (an evaluation, a
    checkpoint, or a hang inside a collective that blocks everyone), nobody is named: progress
    alone cannot tell who is at fault there. Once the others' collectives time out they reach their
    recovery code, and the one left stalled is named.

    Args:
        now: current time, same clock as the change times.
        progress: rank -> (latest progress value, time that value was first seen), for ranks
            whose heartbeat is alive.
        hang_timeout_s: how long progress may stand still; choose it above the collective
            timeout, so ranks blocked on a hung peer have reached recovery by then.
        recovering: ranks that announced they are in their recovery code: never hung, and ahead
            of every rank still in training.
        failure_seen_at: when a dead rank was first seen, if one was. A survivor blocked in a
            collective with it only returns when the collective times out, so no stall is counted
            from before ``failure_seen_at + failure_grace_s``.
        failure_grace_s: how long a blocked collective may take to time out.
        compiling: ranks compiling within their compile timeout: never hung. They do not count as
            moving either (the others may be waiting on them), but one ahead still names those behind.

    Returns:
        The ranks judged hung.
    """
    if hang_timeout_s <= 0:
        raise ValueError(f"--resihp-hang-timeout-s must be > 0, got {hang_timeout_s}")
    training = {r: p for r, p in progress.items() if r not in recovering and r not in compiling}
    if not training:
        return frozenset()
    if failure_seen_at is not None:
        restart = failure_seen_at + failure_grace_s
        training = {r: (value, max(changed, restart)) for r, (value, changed) in training.items()}
    stalled = {r for r, (_, changed) in training.items() if now - changed > hang_timeout_s}
    if not stalled:
        return frozenset()
    someone_moving = len(stalled) < len(training) or any(r in recovering for r in progress)
    top = max(value for r, (value, _) in progress.items() if r not in recovering)
    return frozenset(r for r in stalled if someone_moving or training[r][0] < top)


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
