"""Standbys on Megatron-LM's loop: a rank a plan leaves out stands by outside ``train()`` and enters
it again when it is taken back.

Responsible for the ``training.train`` patch. Megatron's ``train()`` keeps its iteration in a local,
so a spare cannot stay inside it while the job goes on without it. The ``StandingBy`` its recovery
raises unwinds the spare's ``train()`` (from the step, or from a phase between steps); the spare
frees its model and optimizer and waits (``standby.Readmission.stand_by``: it follows the job's
iteration through the store, so injected faults land on time, and exits 0 when the job ends). A
spare (left out by a fail-stop plan) is given a dead rank's place by a later recovery that redoes
iteration N; a rank whose slow replica a fail-slow plan dropped probes its device, and the working
ranks take it back at the top of iteration N once it reports healthy and that pays (a readmission).
Either way it joins the working ranks' change and receives its place's state from live holders
(``reconfigure.apply``), takes over the rebuilt objects as they do, agrees with them where the loop
stands, and calls ``train()`` again with the arguments of the first call, Megatron's counters set to
where the job stands, so that its first step is N and every collective after it meets theirs.

Megatron's loop saves a checkpoint at the top of the first iteration whose micro-batch count
differs from the one ``train()`` started with; the survivors started with the count before this
change, so the standby enters ``train()`` with that count and counts anew as it enters step N, as
they do (a grown world keeps the count: ``megatron_loop_replicas.CountedSplit.set_world``).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.resihp.logging_utils import log_line
from megatron.resihp.megatron_loop_phases import Phase, Position, stop_timers
from megatron.resihp.run_state import StopTraining
from megatron.resihp.standby import StandingBy


class SpareReentry:
    """``train()`` for a process that may stand by and come back; ``loop`` is its
    ``ResilientMegatronLoop`` (the executor, the loop's handles, the phases)."""

    def __init__(self, loop):
        self.loop = loop
        # Between entering train() again and its first step: the survivors are inside that step
        # already, so the barrier train() makes as it starts (in ``print_datetime``) is not met.
        self.entering = False
        self.entered_again = False  # whether train() runs for the second time or later
        self._print_datetime = None

    def install(self) -> None:
        from megatron.training import training

        self._print_datetime = training.print_datetime
        training.print_datetime = self._dated

    def uninstall(self) -> None:
        from megatron.training import training

        if self._print_datetime is not None:
            training.print_datetime = self._print_datetime
            self._print_datetime = None

    def _dated(self, string, override_timestamp=None):
        if not self.entering:
            return self._print_datetime(string, override_timestamp)
        return None  # the line would say when this rank came back, which the log says already

    def train(self, original, *args, **kwargs):
        """Megatron's ``train(*args, **kwargs)``, entered again each time this spare is taken back."""
        while True:
            try:
                return original(*args, **kwargs)
            except StandingBy as stop:
                self._stand_by(stop)
                self.entering = True  # until the step (``ResilientMegatronLoop.train_step``)
                self.entered_again = True

    def _stand_by(self, stop: StandingBy) -> None:
        """Stand by until taken back; then make this process's loop state the job's."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
        from megatron.core.utils import get_attr_wrapped_model
        from megatron.training import get_args

        loop, hooks = self.loop, self.loop.hooks
        log_line(f" resihp: {stop}")
        model, optimizer, scheduler = loop.handles
        old_config = hooks.run.objects.config
        # Nothing of this rank's state is of use when it comes back (it is as old as the iteration
        # it left at): the memory goes now, and the handles are filled again by the take-over.
        model.clear()
        optimizer.__dict__.clear()
        hooks.run = hooks.run.replace(objects=None, part_copies=None)
        try:
            rejoined = hooks.stand_by()
        except StopTraining as end:  # the job ended (or fell back to a checkpoint) while this rank stood by
            loop.leave(hooks.iteration, end)
        number = rejoined.iteration  # the iteration the survivors redo, this rank's first
        args = get_args()
        args.iteration = number - 1
        args.consumed_train_samples = rejoined.consumed_samples
        # Where the loop stands, and Megatron's counters, from the survivors (before the take-over:
        # the rebuilt validation loader starts at their validation samples).
        loop.phases.position = Position(number - 1, Phase.EXIT_CHECK)
        furthest = loop.phases.agree(joining=True)
        counters = dict(loop.phases.counters)
        started_with = counters.pop("num_microbatches")
        for name, value in counters.items():
            setattr(args, name, value)
        rebuilt_scheduler = hooks.run.objects.scheduler
        loop.take_over(model, optimizer, scheduler, old_config, rejoined.consumed_samples)
        # The train() entered now takes its logging's process groups from this model; later
        # re-forms update that collection in place, as they do the survivors'.
        loop.loop_groups = get_attr_wrapped_model(model[0], "pg_collection")
        # The loop's scheduler handle counts steps on; it learns the job's count from the rebuilt one.
        scheduler.num_steps = 0
        scheduler.load_state_dict(rebuilt_scheduler.state_dict())
        loop.counts.as_before(started_with)
        loop.counts.count_anew_at(furthest.iteration)
        stop_timers("interval-time")  # left running by the train() this rank left
        machine = get_rerun_state_machine()
        machine.state = RerunState.NOT_RUNNING_YET
        machine.current_iteration = number - 1
        log_line(f" resihp: launch rank {hooks.run.launch_rank} enters Megatron's loop again at iteration {number} "
                 f"as world rank {dist.get_rank()} of {dist.get_world_size()}")

