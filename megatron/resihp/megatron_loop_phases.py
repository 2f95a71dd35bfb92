"""Between two steps of Megatron-LM's loop: the phases with world-wide collectives, and where the
survivors of a failure in one of them go on from.

Responsible for the patches around what ``megatron.training.train()`` runs after each
``train_step``, each with collectives over the world or its groups: the iteration's log
(``training_log``: the learning rate's all-reduce, the interval timer's barrier, the timers'
all-gather), the evaluation (``evaluate_and_print_results``, between two timer barriers), and the
checkpoint save (``save_checkpoint``, inside ``save_checkpoint_and_time``; periodic, after a change
of the micro-batch count, and the last one), and the exit check after it
(``checkpoint_and_decide_exit``: under --exit-duration-in-mins an all-reduce of whether any rank's
time is up). Under --async-save the finalization of saves at the next iteration's top is a phase
too (``Phase.FINALIZE``, patched by ``async_saves``). A rank that fails in any of them has stepped, so
the survivors re-form (``ResilientMegatronLoop.recover_at``) and go on after that iteration.

A failure surfaces on different ranks in different phases: one rank may be in the save's barrier
while another, past it, is already in the next step. So after re-forming, the survivors exchange
where each stood (``Position``: iteration and phase) and all go on from the furthest one:

- a rank behind it skips what the others have passed, timer barriers included;
- the phase the furthest rank stood in is finished by every survivor the same way: the log
  without its collectives (the re-formed world's last rank prints the line if no process printed
  it); the evaluation not at all (it is lost, and said so); the save made again, unless the tracker
  file names its iteration (rank 0 writes it between the barrier after every rank's files and the
  save's last barrier, so the checkpoint is then whole); the step, run again or counted done as
  ``ResilientMegatronLoop.train_step`` decides.

Every survivor then issues the same collectives in the same order. An interrupted save never
becomes the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.resihp.async_saves import stalled_writes
from megatron.resihp.logging_utils import log_line, rank_name


class Phase(enum.IntEnum):
    """What Megatron's loop runs for one iteration, in its order."""

    STEP = 0  # train_step, before this rank's optimizer stepped
    STEPPED = 1  # train_step, after it
    LOG = 2
    EVAL = 3
    SAVE = 4
    EXIT_CHECK = 5  # the ranks' agreement whether --exit-duration-in-mins has passed (after the save)
    FINALIZE = 6  # Megatron finalizing --async-save saves, at the next iteration's top (``async_saves``)


class Position(NamedTuple):
    """Where a rank stands: the iteration and the last phase of it the rank entered."""

    iteration: int
    phase: Phase

    def __str__(self) -> str:
        return f"iteration {self.iteration}'s {self.phase.name.lower()}"


class _Recovered(Exception):
    """A timer's barrier inside a phase failed and the survivors re-formed: the phase ends here."""


class BetweenSteps:
    """The patches of the phases between steps, and the position the survivors agreed on."""

    def __init__(self, loop):
        self.loop = loop  # ResilientMegatronLoop: its hooks, its recover_at, its rebuilt iterators
        self.position = Position(0, Phase.STEP)
        self.catch_up_to: Position | None = None  # the furthest survivor's position after a re-form
        self.saved: set[int] = set()  # iterations this job's world saved whole
        self.latest_at_start: str | None = None  # what the tracker named before this job saved anything
        self._saved_generation = 0  # the world the checkpointing context's cached strategies belong to
        self._in_phase = False
        self.counters: dict = {}  # the survivors' at the last agreement (``agree``)
        self._original: dict[str, object] = {}

    # ------------------------------------------------------------------ position
    def enter(self, position: Position) -> str:
        """This rank enters ``position``: "run" it, "skip" it (the others passed it), or "finish" it
        (the furthest survivor failed in it; each phase finishes its own way)."""
        self.position = position
        target = self.catch_up_to
        if target is None or position > target:
            self.catch_up_to = None
            return "run"
        return "skip" if position < target else "finish"

    def agree(self, joining: bool = False) -> Position:
        """After a re-form, on every member: the furthest position any survivor stood at. A spare
        taken back (``joining``) also learns the survivors' counters (``counters``: Megatron's
        sample and FLOP counts, the data-parallel size its arithmetic is given, and the micro-batch
        count its loop started this world with)."""
        entries: list = [None] * dist.get_world_size()
        dist.all_gather_object(entries, (tuple(self.position), None if joining else _loop_counters(),
                                         self.loop.saves.agreement(joining)))
        furthest = max(Position(i, Phase(p)) for (i, p), _, _ in entries)
        self.counters = next(c for _, c, _ in entries if c is not None)
        self.loop.saves.agreed([s for _, _, s in entries], furthest.iteration)
        self.catch_up_to = furthest if furthest > self.position else None
        if furthest.phase is Phase.SAVE and self.tracker_names(furthest.iteration):
            self.saved.add(furthest.iteration)
        if self.catch_up_to is not None:
            run = self.loop.hooks.run
            log_line(f" resihp: {rank_name(run.rank, run.identity)} stood at {self.position}; the furthest "
                     f"survivor at {furthest}: going on from there")
        return furthest

    def _barriers_run(self) -> bool:
        return self.catch_up_to is None or self.position >= self.catch_up_to

    # ------------------------------------------------------------------ patches
    def install(self) -> None:
        from megatron.core.timers import Timer
        from megatron.training import training

        self._original = {
            "training_log": training.training_log,
            "evaluate_and_print_results": training.evaluate_and_print_results,
            "save_checkpoint": training.save_checkpoint,
            "save_checkpoint_and_time": training.save_checkpoint_and_time,
            "checkpoint_and_decide_exit": training.checkpoint_and_decide_exit,
            "Timer.start": Timer.start,
            "Timer.stop": Timer.stop,
        }
        training.training_log = self._training_log
        training.evaluate_and_print_results = self._evaluate_and_print_results
        training.save_checkpoint = self._save_checkpoint
        training.save_checkpoint_and_time = self._save_checkpoint_and_time
        training.checkpoint_and_decide_exit = self._checkpoint_and_decide_exit
        Timer.start = self._timer_method("Timer.start")
        Timer.stop = self._timer_method("Timer.stop")

    def uninstall(self) -> None:
        from megatron.core.timers import Timer
        from megatron.training import training

        for name, fn in self._original.items():
            if name.startswith("Timer."):
                setattr(Timer, name.split(".")[1], fn)
            else:
                setattr(training, name, fn)
        self._original = {}

    def recovering(self) -> bool:
        hooks = self.loop.hooks
        return hooks is not None and hooks.can_recover

    def _timer_method(self, name: str):
        """``Timer.start``/``Timer.stop`` whose barrier a failure does not escape: Megatron calls them
        with ``barrier=True`` around the evaluation and the save, outside any patched phase."""
        method = self._original[name]

        def timed(timer, barrier=False):
            if not barrier or not self.recovering():
                return method(timer, barrier)
            if not self._barriers_run():  # catching up: the others are past this barrier
                return method(timer, False)
            try:
                return method(timer, True)
            except RuntimeError as error:  # the barrier raised before the timer changed
                self.loop.recover_at(self.position, error)
                # A start is finished, so that the timer runs as its caller expects; a stop inside a
                # phase is not: the phase ends here, and ``Timer.elapsed`` (which stops, resets and
                # starts again) would otherwise leave its timer stopped and reset.
                if name == "Timer.start" or not self._in_phase:
                    method(timer, False)
                if self._in_phase:
                    raise _Recovered() from error
                return None

        return timed

    @contextlib.contextmanager
    def _phase(self):
        self._in_phase = True
        try:
            yield
        finally:
            self._in_phase = False

    def _recover(self, error: Exception) -> None:
        """A collective of the phase at ``self.position`` failed (unless a timer already recovered)."""
        if not isinstance(error, _Recovered):
            self.loop.recover_at(self.position, error)

    # ------------------------------------------------------------------ the log
    def _training_log(self, loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                      *args, **kwargs):
        """Megatron's ``training_log`` of ``iteration``, survived when its collectives fail."""
        from megatron.training import training

        log = self._original["training_log"]
        call = (loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag, *args)
        if self.loop.spares.entered_again:
            # A spare's train() entered again starts mid-job: its first iteration is logged (and its
            # collectives run) as the survivors log theirs, not as a job's first.
            kwargs["is_first_iteration"] = False
        if not self.recovering():
            return log(*call, **kwargs)
        mode = self.enter(Position(iteration, Phase.LOG))
        if mode == "skip":
            return report_memory_flag
        self.loop.hooks.inject(iteration, "log")
        if not loss_dict:
            # The step's loss was lost to a failure after this rank's optimizer stepped: a line
            # without it, rather than a loss of 0 from the sums the last line reset.
            for key in [k for k, v in total_loss_dict.items() if hasattr(v, "sum") and float(v.sum()) == 0.0]:
                del total_loss_dict[key]
        totals = dict(total_loss_dict)  # its values are replaced, never changed in place
        printed = []
        print_rank_last = training.print_rank_last
        training.print_rank_last = lambda message: (printed.append(dist.get_rank() == dist.get_world_size() - 1),
                                                    print_rank_last(message))
        try:
            if mode == "run":
                try:
                    with self._phase():
                        return log(*call, **kwargs)
                except (RuntimeError, _Recovered) as error:  # a peer died or hung in one of its collectives
                    if not self.recovering():
                        raise
                    self._recover(error)
            # Every survivor finishes this log without its collectives (also when others are past
            # it: a barrier lets some ranks out before others); the re-formed world's last rank
            # prints the line when no process printed it before the failure.
            if any(printed) or dist.get_rank() != dist.get_world_size() - 1:
                return report_memory_flag
            total_loss_dict.clear()
            total_loss_dict.update(totals)
            with _alone():
                return log(*call, **kwargs)
        finally:
            training.print_rank_last = print_rank_last

    # ------------------------------------------------------------------ the evaluation
    def _evaluate_and_print_results(self, prefix, forward_step_func, data_iterator, model, iteration, *args,
                                    **kwargs):
        evaluate = self._original["evaluate_and_print_results"]
        data_iterator = self.loop.data.eval_iterator(data_iterator)
        if not self.recovering():
            return evaluate(prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs)
        mode = self.enter(Position(iteration, Phase.EVAL))
        if mode == "run":
            self.loop.hooks.inject(iteration, "eval")
            try:
                with self._phase():
                    return evaluate(prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs)
            except (RuntimeError, _Recovered) as error:
                if not self.recovering():
                    raise
                self._recover(error)
                stop_timers("evaluate")  # started as the evaluation began, stopped as it ends
                mode = "finish" if self.catch_up_to is None else self.enter(self.position)
        if mode == "finish":
            log_line(f" resihp: the evaluation at iteration {iteration} is lost to the failure; training goes on")
        return None

    # ------------------------------------------------------------------ the save
    def _save_checkpoint(self, iteration, *args, **kwargs):
        """Megatron's ``save_checkpoint`` of ``iteration``, survived when a rank fails during it; its
        writes held back by an injected storage stall, if one is due."""
        stall_s = self.loop.hooks.stall_in_save(iteration) if self.loop.hooks is not None else 0.0
        with stalled_writes(stall_s, self.loop.saves.on()):
            return self._save_checkpoint_surviving(iteration, *args, **kwargs)

    def _save_checkpoint_surviving(self, iteration, *args, **kwargs):
        save = self._original["save_checkpoint"]
        if not self.recovering():
            return save(iteration, *args, **kwargs)
        if self.enter(Position(iteration, Phase.SAVE)) == "skip" or iteration in self.saved:
            # Passed by the others (the tracker names it), or saved whole by this world already:
            # Megatron saves again after a change of the micro-batch count, at an iteration it may
            # just have saved, and a failure while its files were rewritten could not be told from
            # one before they were.
            log_line(f" resihp: iteration {iteration} is saved already; not saving it again")
            return None
        call = inspect.signature(save).bind(iteration, *args, **kwargs)
        self.loop.hooks.inject(iteration, "save")
        if self.loop.saves.on():
            return self._save_async(iteration, save, call)
        while True:
            self._refresh_save_groups(call)
            try:
                with self._faults_in_save(iteration):
                    result = save(*call.args, **call.kwargs)
                self.saved.add(iteration)
                return result
            except RuntimeError as error:  # a peer died or hung in one of the save's collectives
                if not self.recovering():
                    raise
                self._recover(error)
            if iteration in self.saved:  # agree() found the tracker naming it
                log_line(f" resihp: the checkpoint of iteration {iteration} was whole when the failure came")
                return None
            log_line(f" resihp: saving iteration {iteration} again, on the re-formed world")

    def _save_async(self, iteration, save, call: inspect.BoundArguments):
        """Megatron's save of ``iteration`` under --async-save: it returns once this rank's writer has
        the tensors, and its files are finished at a later step's top (``async_saves``). A failure
        while saving ends the save on every survivor alike: some had handed theirs to the writer
        (their saves are dropped), others had not; all of them agree to make it again
        (``AsyncSaves.finalize``), never here, where they would not meet in the same collectives."""
        self._refresh_save_groups(call)
        try:
            result = save(*call.args, **call.kwargs)
        except RuntimeError as error:
            if not self.recovering():
                raise
            self.loop.saves.lost_in_save(iteration, call)
            self._recover(error)
            if self._in_phase:
                raise _Recovered() from error
            return None
        self.loop.saves.scheduled(iteration, call)
        self.saved.add(iteration)
        self.loop.hooks.inject(iteration, "save-scheduled")
        return result

    def save_again(self, iteration: int, call: inspect.BoundArguments) -> None:
        """Make the save of ``iteration`` again (``call``: its arguments), on the re-formed world.
        Every member agreed to (``AsyncSaves.agreed``), a survivor that stood behind in that
        iteration's save included: none of them skips it as one the others passed."""
        self.saved.discard(iteration)
        self.catch_up_to = None
        self._save_checkpoint(*call.args, **call.kwargs)

    def start(self) -> None:
        """As training starts: remember what the tracker names, so that a later reading tells this
        job's saves from a run's before it."""
        self.latest_at_start = _latest_checkpoint()

    def latest_saved(self) -> str | None:
        """What the tracker file names now (None: no --save, or nothing saved yet)."""
        return _latest_checkpoint()

    def tracker_names(self, iteration: int) -> bool:
        """The tracker file names ``iteration``, and this job wrote it (not a run before it)."""
        latest = _latest_checkpoint()
        return latest == str(iteration) and latest != self.latest_at_start

    def _refresh_save_groups(self, call: inspect.BoundArguments) -> None:
        """A save after a re-form uses the new world's groups: the ones ``save_checkpoint_and_time``
        read from the model before the failure are gone, and the checkpointing context caches a
        save strategy built on the old data-parallel group."""
        from megatron.core.utils import unwrap_model

        generation = self.loop.hooks.run.generation
        if generation == self._saved_generation:
            return
        self._saved_generation = generation
        context = call.arguments.get("checkpointing_context")
        if context:
            context.pop("save_strategy", None)
            context.pop("load_strategy", None)
        groups = getattr(unwrap_model(call.arguments["model"])[0], "pg_collection", None)
        for name, attribute in (("tp_group", "tp"), ("pp_group", "pp"), ("dp_group", "dp"),
                                ("dp_cp_group", "dp_cp_gtp_remat"), ("expt_dp_group", "expt_dp")):
            if call.arguments.get(name) is not None:
                call.arguments[name] = getattr(groups, attribute, None)

    @contextlib.contextmanager
    def _faults_in_save(self, iteration: int):
        """``during=save-write`` kills: the save's first barrier is the one after this rank's files.
        ``during=save-tracker`` kills (rank 0, which writes Megatron's tracker): as rank 0 names the
        tracker file, after every rank's files are written and before the tracker says so."""
        import megatron.training.checkpointing as checkpointing

        phases = {f.during for f in self.loop.hooks.faults} & {"save-write", "save-tracker"}
        if not phases:
            yield
            return
        barrier, tracker = dist.barrier, checkpointing.get_checkpoint_tracker_filename
        calls = []

        def first_barrier_kills(*args, **kwargs):
            if not calls:
                calls.append(True)
                self.loop.hooks.inject(iteration, "save-write")
            return barrier(*args, **kwargs)

        def tracker_kills(*args, **kwargs):
            self.loop.hooks.inject(iteration, "save-tracker")
            return tracker(*args, **kwargs)

        if "save-write" in phases:
            dist.barrier = first_barrier_kills
        if "save-tracker" in phases:
            checkpointing.get_checkpoint_tracker_filename = tracker_kills
        try:
            yield
        finally:
            dist.barrier, checkpointing.get_checkpoint_tracker_filename = barrier, tracker

    def _save_checkpoint_and_time(self, iteration, *args, **kwargs):
        """Megatron's ``save_checkpoint_and_time``: around the save (survived in ``_save_checkpoint``)
        it stops and restarts the interval timer (with a barrier) and logs the save's time over the
        world; a failure there goes on after ``iteration`` like one in the save."""
        from megatron.training.global_vars import get_timers

        outer = self._original["save_checkpoint_and_time"]
        if not self.recovering():
            return outer(iteration, *args, **kwargs)
        if self.enter(Position(iteration, Phase.SAVE)) == "skip":
            return None
        try:
            with self._phase():
                return outer(iteration, *args, **kwargs)
        except (RuntimeError, _Recovered) as error:
            if not self.recovering():
                raise
            self._recover(error)
            stop_timers("save-checkpoint", "save-checkpoint-non-persistent")
            interval = get_timers()("interval-time", log_level=0)
            if not interval._started:  # stopped for the save; its restart did not come
                interval.start()
            return None

    # ------------------------------------------------------------------ the exit check
    def _checkpoint_and_decide_exit(self, *args, **kwargs):
        """Megatron's ``checkpoint_and_decide_exit``, whose last collective, under
        --exit-duration-in-mins, is an all-reduce of whether any rank's time is up (its saves and
        timers survive their own failures). A failure there is survived: the re-formed world agrees
        again, and a time that is up ends the job as Megatron's own check would."""
        from megatron.training import get_args, training

        decide = self._original["checkpoint_and_decide_exit"]
        margs = get_args()
        limit = margs.exit_duration_in_mins
        if not self.recovering() or not limit:
            return decide(*args, **kwargs)
        call = inspect.signature(decide).bind(*args, **kwargs)
        iteration = call.arguments["iteration"]
        self.loop.hooks.inject(iteration, "exit-check")
        try:
            return decide(*args, **kwargs)
        except RuntimeError as error:
            if not self.recovering():
                raise
            self.loop.recover_at(Position(iteration, Phase.EXIT_CHECK), error)
        while True:
            if self.catch_up_to is not None:  # a survivor went on to the next step: nobody's time was up
                return False
            try:
                # A survivor that was behind meets this all-reduce with Megatron's own, as it catches up.
                minutes = (time.time() - training._TRAIN_START_TIME) / 60.0
                up = torch.tensor([minutes > limit], dtype=torch.int, device=self.loop.hooks.device())
                dist.all_reduce(up, op=dist.ReduceOp.MAX)
                break
            except RuntimeError as error:
                self.loop.recover_at(Position(iteration, Phase.EXIT_CHECK), error)
        if not up.item():
            return False
        given = call.arguments
        if margs.save and not _saved_on_schedule(margs, iteration):
            training.save_checkpoint_and_time(iteration, given["model"], given["optimizer"],
                                              given["opt_param_scheduler"], given["num_floating_point_operations_so_far"],
                                              given["checkpointing_context"],
                                              train_data_iterator=given.get("train_data_iterator"))
        training.print_datetime(f"exiting program after {minutes} minutes")
        return True


def _saved_on_schedule(args, iteration: int) -> bool:
    """Whether Megatron's ``checkpoint_and_decide_exit`` saved ``iteration`` before its exit checks
    (a periodic or non-persistent save), so that a time that is up needs no save of its own."""
    return bool((args.save_interval and iteration % args.save_interval == 0)
                or (args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0))


def _loop_counters() -> dict:
    """What a spare taken back needs of Megatron's counters to go on as the survivors do."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    args = get_args()
    counters = {name: getattr(args, name) for name in (
        "consumed_valid_samples", "skipped_train_samples", "num_floating_point_operations_so_far",
        "data_parallel_size")}
    return {**counters, "num_microbatches": get_num_microbatches()}


def stop_timers(*names: str) -> None:
    """Stop Megatron's timers ``names`` if a phase cut short left them running (each asserts it is
    not running when it starts again)."""
    from megatron.training.global_vars import get_timers

    for name in names:
        timer = get_timers()._timers.get(name)
        if timer is not None and getattr(timer, "_started", False):
            timer.reset()


def _latest_checkpoint() -> str | None:
    """What Megatron's tracker file under ``--save`` names (None: no ``--save``, or no save yet)."""
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    save = get_args().save
    if not save:
        return None
    try:
        return Path(get_checkpoint_tracker_filename(save)).read_text().strip()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _alone():
    """The collectives Megatron's ``training_log`` runs (the learning rate's all-reduce, the interval
    timer's barrier, the timers' all-gather) as this rank alone would see them, for one rank's replay
    of a log line after the world that ran them failed: an all-reduce of one rank leaves its value."""
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    saved = dist.barrier, dist.all_reduce
    dist.barrier = dist.all_reduce = lambda *args, **kwargs: None
    timers.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.barrier, dist.all_reduce = saved
        del timers.log
