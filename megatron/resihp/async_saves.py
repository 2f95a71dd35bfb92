"""Megatron-LM's asynchronous checkpoint saves (``--async-save``) when ranks fail and the world changes.

Responsible for the saves whose files are still being written while training goes on. A save
hands this rank's tensors to its writer process and returns; a later step's start finalizes it
(``maybe_finalize_async_save``: an all-reduce of whether every rank's writer is done, the gather
of what each wrote, rank 0's metadata and the tracker file). Such a save belongs to the world
that planned it:

- **Before a planned change** (a re-plan, a readmission) every member is alive: the saves still
  being written are finished in the old world, blocking (``settle(keep=True)``), so that the
  new world starts with none.
- **After a failure** no save of the old world can be finished: the lost rank's part is missing,
  and the gather would run in the re-formed world. Each survivor drops its saves
  (``settle(keep=False)``): its writer process is killed (a killed save never reaches the
  tracker, which still names the last whole checkpoint), what that writer reported is discarded
  so a later save cannot read it as its own, Megatron's queue is emptied and a fresh writer is
  started. The next save starts from scratch.
- **A save lost while the loop stands at its iteration** (the failure came in the save, or in
  the finalization at the next step's top, before any step ran since) is made again by every
  member, in the re-formed world: the survivors agree on it (``agreement``/``agreed``) and
  ``finalize`` saves it before going on. A save whose iteration the loop has passed is lost,
  said so in the log; the next one comes at its interval.
- **Megatron's finalization** at each step's top and at the end is survived like the other phases
  between steps (``megatron_loop_phases.Phase.FINALIZE``).
- **Writers die with their rank**: each writer process (and the process that serves the queue
  of their results) asks the kernel for SIGKILL when its parent dies, so a killed or evicted rank
  leaves no process writing into a folder its successors save to.
- **An injected storage stall** (``stall:`` in ``--resihp-inject``) holds a save's writes back:
  its writer waits before writing (``stalled_writes``), so a save is still being written, however
  fast the storage, when a later fault strikes.

Checked against megatron-core 0.19.2's own asynchronous saves (``--async-strategy mcore``); the
``nvrx`` strategy runs in nvidia-resiliency-ext's processes, which this does not reach
(``megatron_loop_support`` refuses it with ``--resihp-enable``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import os
import queue
import signal
import time

from megatron.resihp.logging_utils import log_line
from megatron.resihp.parent_death import signal_on_parent_death


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; a no-op elsewhere). A writer started by
    a fork server is that server's child, and the server exits when the rank that started it dies."""
    parent = os.getppid()
    if signal_on_parent_death(signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)  # the parent died before the request: nobody would send the signal


def _megatron_writer_loop():
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    return PersistentAsyncCaller.__dict__["async_loop"].__func__


_WRITER_LOOP = _megatron_writer_loop()  # read as this module is imported: a spawned writer imports it unpatched


def writer_loop(*args, **kwargs):
    """Megatron's persistent writer process, made to die with its rank. Module-level, so that a
    writer started by a fork server or spawned finds it by name."""
    die_with_parent()
    return _WRITER_LOOP(*args, **kwargs)


def write_late(seconds: float, write, *args, **kwargs):
    """A save's writes, ``seconds`` late (an injected storage stall). Module-level, so that the
    writer process finds it by name."""
    time.sleep(seconds)
    return write(*args, **kwargs)


@contextlib.contextmanager
def stalled_writes(seconds: float, asynchronous: bool):
    """Within it, a save's writes wait ``seconds``: under --async-save its writer process waits
    and training goes on; otherwise the rank waits before saving."""
    if seconds <= 0:
        yield
        return
    if not asynchronous:
        time.sleep(seconds)
        yield
        return
    from megatron.training import checkpointing

    schedule = checkpointing.schedule_async_save

    def schedule_late(request):
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(write_late, seconds, request.async_fn))
        return schedule(request)

    checkpointing.schedule_async_save = schedule_late
    try:
        yield
    finally:
        checkpointing.schedule_async_save = schedule


def write_results_queue(mp_mode: str = "spawn"):
    """megatron-core's ``get_write_results_queue``, its serving process made to die with its rank."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context(mp_mode))
        manager.start(initializer=die_with_parent)
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps the manager alive
    return filesystem_async._results_queue


class AsyncSaves:
    """This rank's saves still being written, and the patches that keep them to one world."""

    def __init__(self, loop):
        self.loop = loop  # ResilientMegatronLoop: its phases, its recover_at, its hooks
        self.pending: list[int] = []  # iterations whose saves were handed to the writer, not finalized
        self.unsaved: int | None = None  # a save this rank lost in the last failure (until agreed)
        self.save_again: int | None = None  # the lost save every member makes again (agreed)
        self.save_call = None  # the last save's arguments (``inspect.BoundArguments``), to make it again
        self._original: dict[str, object] = {}

    # ------------------------------------------------------------------ patches
    def install(self) -> None:
        from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
        from megatron.training import training

        self._original = {
            "maybe_finalize_async_save": training.maybe_finalize_async_save,
            "async_loop": async_utils.PersistentAsyncCaller.__dict__["async_loop"],
            "get_write_results_queue": filesystem_async.get_write_results_queue,
        }
        training.maybe_finalize_async_save = self.finalize
        async_utils.PersistentAsyncCaller.async_loop = staticmethod(writer_loop)
        filesystem_async.get_write_results_queue = self._results_queue

    def _results_queue(self, mp_mode: str = "spawn"):
        """The queue of the writers' reports: one served by a process that dies with this rank under
        --async-save, else the one installed before (``sync_save_results``' in-process queue)."""
        if self.on():
            return write_results_queue(mp_mode)
        return self._original["get_write_results_queue"](mp_mode)

    def uninstall(self) -> None:
        from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
        from megatron.training import training

        if not self._original:
            return
        training.maybe_finalize_async_save = self._original["maybe_finalize_async_save"]
        async_utils.PersistentAsyncCaller.async_loop = self._original["async_loop"]
        filesystem_async.get_write_results_queue = self._original["get_write_results_queue"]
        self._original = {}

    @staticmethod
    def on() -> bool:
        from megatron.training import get_args

        return bool(getattr(get_args(), "async_save", False))

    @staticmethod
    def _queue():
        from megatron.training import async_utils

        return async_utils._async_calls_queue

    def _unfinalized(self) -> int:
        """How many saves Megatron's queue holds unfinalized (0 before the first save)."""
        calls = self._queue()
        return calls.get_num_unfinalized_calls() if calls is not None else 0

    # ------------------------------------------------------------------ the save
    def scheduled(self, iteration: int, call: inspect.BoundArguments) -> None:
        """This rank's save of ``iteration`` was handed to its writer (``call``: Megatron's arguments)."""
        self.pending.append(iteration)
        self.save_call = call

    def lost_in_save(self, iteration: int, call: inspect.BoundArguments) -> None:
        """A failure came while this rank saved ``iteration``: nothing of it is kept (the save is
        made again where the survivors agree on it, ``finalize``)."""
        self.unsaved = iteration
        self.save_call = call

    # ------------------------------------------------------------------ a change of world
    def settle(self, keep: bool) -> None:
        """Before a layout change: finish this world's saves (``keep``: every member is alive), or
        drop them (a member failed)."""
        if not self.on():
            return
        if keep:
            if self._unfinalized():
                log_line(f" resihp: finishing the save of iteration(s) {self.pending} before the world changes")
                self._queue().maybe_finalize_async_calls(blocking=True)
                self._emit(kept=True)
            self.pending = []
        elif self.pending or self._unfinalized():
            self._drop()
        calls = self._queue()
        if calls is not None:
            # Megatron checks that every rank finalizes the same call by its number: the new world
            # counts from zero on every member (a standby taken back missed the saves made without it).
            calls.call_idx = -1

    def _drop(self) -> None:
        self._drop_writer()
        self._emit(kept=False)
        dropped, self.pending = self.pending, []
        if dropped:
            self.unsaved = max(dropped + ([self.unsaved] if self.unsaved is not None else []))
            self.loop.phases.saved.difference_update(dropped)
            log_line(f" resihp: the save of iteration(s) {dropped} was still being written when the failure came; "
                     f"dropped (the tracker names {self.loop.phases.latest_saved() or 'no checkpoint'})")

    def _emit(self, kept: bool) -> None:
        self.loop.events.emit("saves_settled", self.loop.phases.position.iteration, kept=kept,
                              iterations=list(self.pending))

    def _drop_writer(self) -> None:
        """Kill this rank's writer, forget what it was given and reported, and start a fresh one."""
        from megatron.core.dist_checkpointing.strategies import async_utils as core_async
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.training import async_utils, get_args, initialize

        caller = core_async.PersistentAsyncCaller
        process = caller._persistent_process
        if process is not None:
            process.kill()
            process.join()
        # The old callers forget their process: a caller's ``__del__`` closes "its" writer through
        # the class's queues, which by the time the garbage collector runs it are the new writer's.
        calls = async_utils._async_calls_queue
        for old in {id(c.async_caller): c.async_caller for c in (calls.async_calls if calls else ())}.values():
            old.process = None
        if core_async.AsyncCallsQueue._persistent_caller is not None:
            core_async.AsyncCallsQueue._persistent_caller.process = None
        caller._persistent_process = caller._persistent_queue = None
        caller._persistent_preload_q = caller._persistent_comp_q = None
        core_async.AsyncCallsQueue._persistent_caller = None
        async_utils._async_calls_queue = None
        results = filesystem_async._results_queue
        while results is not None:
            try:
                results.get_nowait()  # a finished write's report: a later save would take it for its own
            except queue.Empty:
                break
        args = get_args()
        if args.use_persistent_ckpt_worker:
            # Megatron's own start (a fork server's process; forked on a CPU host: ``cpu_training``).
            initialize.init_persistent_async_worker(self.loop.hooks.run.launch_rank, "forkserver")

    # ------------------------------------------------------------------ the agreement
    def agreement(self, joining: bool) -> tuple:
        """What this member brings to the survivors' agreement: the save it lost, and whether it can
        make a save again (a spare taken back holds no save's arguments)."""
        return (self.unsaved, self.save_call is not None and not joining)

    def agreed(self, entries: list[tuple], furthest_iteration: int) -> None:
        """From every member's ``agreement``: the lost save all of them make again, if any. Only
        a save of the iteration the loop stands at is made again: once a step ran, its state is gone."""
        lost = [u for u, _ in entries if u is not None]
        self.unsaved = None
        self.save_again = None
        if not lost:
            return
        iteration = max(lost)
        if iteration == furthest_iteration and all(able for _, able in entries):
            self.save_again = iteration
        elif not self.loop.phases.tracker_names(iteration):
            log_line(f" resihp: the checkpoint of iteration {iteration} is lost to the failure; the next save "
                     f"comes at its interval")

    # ------------------------------------------------------------------ Megatron's finalization
    def finalize(self, blocking: bool = False, terminate: bool = False):
        """Megatron's ``maybe_finalize_async_save`` (each step's top, and the end), survived when a
        rank fails in its collectives; a lost save of the iteration the loop stands at is made again
        first."""
        from megatron.resihp.megatron_loop_phases import Phase, Position

        original = self._original["maybe_finalize_async_save"]
        phases = self.loop.phases
        if not phases.recovering() or not self.on():
            return original(blocking=blocking, terminate=terminate)
        iteration = phases.position.iteration
        if phases.enter(Position(iteration, Phase.FINALIZE)) == "skip":
            return None
        while True:
            if self.save_again == iteration and not phases.tracker_names(iteration):
                self.save_again = None
                log_line(f" resihp: saving iteration {iteration} again, on the re-formed world")
                phases.save_again(iteration, self.save_call)
                phases.enter(Position(iteration, Phase.FINALIZE))
            before = self._unfinalized()
            if before:
                self.loop.hooks.inject(iteration, "finalize")
            try:
                result = original(blocking=blocking, terminate=terminate)
            except RuntimeError as error:  # a peer died or hung in the finalization's collectives
                self.loop.recover_at(Position(iteration, Phase.FINALIZE), error)
                continue
            del self.pending[:before - self._unfinalized()]
            return result
