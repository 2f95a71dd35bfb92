"""A rank of Megatron-LM's loop lost while Megatron sets the job up, before the first step.

Responsible for telling that case apart and ending it cleanly: nothing of the launch was trained,
so there is nothing to recover in place; every rank leaves with ``EXIT_NEEDS_RESTART`` and the
command that runs the job again, instead of a traceback per rank.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from megatron.resihp.failure_origin import is_peer_failure
from megatron.resihp.logging_utils import log_line, ranks_name
from megatron.resihp.run_state import StopTraining


def leave_before_training(loop, error: Exception) -> None:
    """``error`` ended Megatron's set-up under ``loop`` (``ResilientMegatronLoop``), before its first
    step. When it is a peer's failure and the heartbeats name a failed rank, this rank leaves with
    ``EXIT_NEEDS_RESTART`` and the command that runs the job again (nothing of this launch was
    trained); else it returns, and the caller re-raises ``error`` (this rank's own, or a failure
    nobody can name)."""
    from megatron.resihp.fail_stop_recovery import EXIT_NEEDS_RESTART, resume_command
    from megatron.training import get_args

    hooks = loop.hooks
    if loop.handles is not None or hooks is None or not hooks.can_recover or not is_peer_failure(error):
        return
    deadline = time.monotonic() + 2 * loop.cfg.heartbeat_timeout_s
    while not (lost := hooks.monitor.dead_ranks | hooks.monitor.hung_ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not lost:
        return
    hooks.abandon_world()  # the others may still wait on this rank
    args = get_args()
    command = resume_command(sys.argv, dist.get_world_size(), args.load)
    if dist.get_rank() == min(set(range(dist.get_world_size())) - lost):
        log_line(f" resihp: run again with: {command}")
    loop.events.emit("start_failed", args.iteration, failed_ranks=sorted(lost), resume_command=command,
                     error=str(error).splitlines()[0])
    hooks.unwatch()  # leaves cleanly: the others must not count this rank among the failed
    loop.leave(args.iteration, StopTraining(EXIT_NEEDS_RESTART, (
        f"{ranks_name(lost, hooks.run.identity)} failed while Megatron set the job up, before the first "
        "iteration; nothing of this launch was trained, so the job is run again")))
