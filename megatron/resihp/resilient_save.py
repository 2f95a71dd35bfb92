"""Checkpoint saves, and the end of a finished job, that a rank lost in the middle does not crash.

Responsible for what the surviving ranks do when a rank dies while a checkpoint is being saved, and
when one dies as a job that finished training ends. It never decides a plan (recovery does) and
never writes a checkpoint file itself (``checkpointing`` does).

* **A save.** Every phase of ``checkpointing.save_checkpoint`` (before any file is written, while
  they are written, around the rename of ``iter_X.tmp`` and the tracker file) ends in a barrier,
  which fails on the survivors. They recover as from any failed collective, with the iteration
  counted as done (its optimizer step was taken), and then look at the tracker: if it names this
  iteration, the rank that renames had finished before the failure surfaced and the save is
  complete; otherwise they save the iteration again on the new world. Saving again rather than
  leaving it to the next interval: the checkpoint asked for at this iteration then exists, which
  matters most right after a failure (and at the last iteration there is no next interval), for
  the cost of one save. With no in-place plan the survivors take the fallback (exit 3): they save
  this iteration from the shards they hold, or name the last complete checkpoint. An interrupted
  save is never named by the tracker (``checkpointing``'s protocol), so no load reads it.
* **The end.** After the last iteration and its checkpoint the ranks leave together through a
  barrier. Once every rank has passed the save's last barrier, the checkpoint is complete and
  training is done, so a rank lost at that point costs nothing: the survivors log it and exit 0,
  which tells a supervisor that the job's work is done and saved.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch.distributed as dist

from megatron.resihp import checkpointing
from megatron.resihp.logging_utils import EventLog, log_line


def phase_faults(resilience, iteration: int) -> Callable[[str], None]:
    """What strikes at each phase of a save or of the job's end at ``iteration``: the kills
    injected with ``during=<phase>`` (``resihp_ext.faults.PHASES``), none without resilience."""
    if resilience is None:
        return lambda phase: None
    return lambda phase: resilience.inject(iteration, phase)


def save(args: argparse.Namespace, iteration: int, consumed_samples: int, objects, quotas, resilience,
         events: EventLog) -> tuple:
    """Save the checkpoint of ``iteration`` (collective), through the failure of any rank.

    Args:
        args: the run's arguments (``--save``).
        iteration: the iteration just finished.
        consumed_samples: samples consumed up to and including it.
        objects: the training objects to save.
        quotas: the running split of the global batch over replicas.
        resilience: the run's ``ResilienceHooks``, or None (a failure then raises).
        events: the event log; a ``checkpoint`` event marks the complete save.

    Returns:
        (objects, quotas): the ones given, or those rebuilt on the new world by a recovery.

    Raises:
        StopTraining: this rank left during a recovery (a spare, or the fallback: exit 3).
        RuntimeError: a collective failed and no recovery is possible.
    """
    while True:
        try:
            checkpointing.save_checkpoint(args, iteration, consumed_samples, objects, phase_faults(resilience, iteration))
            break
        except RuntimeError as error:  # a rank died or hung during the save
            if resilience is None or not resilience.can_recover:
                raise
            objects, quotas = resilience.recover(iteration, error, objects, consumed_samples, quotas,
                                                 completed=iteration)
            # Every survivor reads the tracker after the recovery, when no rank is still saving:
            # the old world's rank 0 either finished the rename and the tracker before it met the
            # others in recovery, or it is dead.
            if checkpointing.latest_iteration(args.save) == iteration:
                log_line(f" resihp: rank {dist.get_rank()}: the save of iteration {iteration} had completed "
                         "before the failure")
                break
            log_line(f" resihp: rank {dist.get_rank()}: saving iteration {iteration} again on the new world")
    events.emit("checkpoint", iteration, path=args.save)
    return objects, quotas


def leave_together(args: argparse.Namespace, at_phase: Callable[[str], None]) -> None:
    """The job's end: wait for every rank, then destroy every group explicitly (letting gloo tear
    them down at interpreter exit can abort a process that finished its work).

    A rank lost here (the barrier fails) is logged and otherwise ignored: training finished and
    its last checkpoint, if any, is complete, so this rank exits as a finished one.
    """
    from megatron.resihp.parallel_state_patch import installed, teardown

    at_phase("shutdown")
    try:
        dist.barrier()
    except RuntimeError as error:
        saved = f" and its checkpoint under {args.save} is complete" if args.save else ""
        log_line(f" resihp: rank {dist.get_rank()}: a rank failed as the job ended "
                 f"({str(error).splitlines()[0][:120]}); training had finished{saved}, so this rank exits normally")
    if installed() is not None:  # the run's groups: start-up's, or the last layout change's
        teardown(installed())
    dist.destroy_process_group()
