"""Fail-stop resilience inside Megatron-LM's own training loop (``--resihp-loop megatron``).

Responsible for the patch points of megatron-core 0.19.2's ``megatron.training`` through which this
process's executor (``ResilienceHooks``, its fail-stop driver and the one life cycle,
``reconfigure.apply``) runs inside Megatron's ``train()``:

- ``parallel_state.initialize_model_parallel``: the launch Layout's groups, made by
  ``parallel_state_patch.build_groups`` (their memberships equal megatron-core's), so that a later
  re-form can replace them;
- ``training.train_step``: every iteration beats the heartbeat and applies injected faults, then
  runs Megatron's own step on the current objects. When a collective fails, the survivors agree on
  a plan and re-form in place; the same iteration then runs again on the new world, or, when this
  rank's optimizer had already stepped, counts as done;
- ``training.build_pretraining_data_loader``: remembers the datasets, so that a re-formed world's
  loaders are rebuilt at the samples already consumed, for the new data-parallel rank and size;
- ``training.training_log``: Megatron logs an iteration with world-wide collectives (the interval
  timer's barrier, the timers' all-gather). A rank that fails there had stepped, as had every rank
  that reached it, so the survivors re-form and go on after that iteration; the re-formed world's
  last rank prints the iteration's line when no process printed it before the failure;
- ``training.save_checkpoint`` (every save of the loop, the last one included, goes through it):
  a rank that fails during a save had stepped, so the survivors re-form and go on after that
  iteration; the save is then made again on the re-formed world, unless the tracker file already
  names it (rank 0 writes it only once every rank has written its files, so the checkpoint is
  whole, and a rank that passed the save's last barrier is past the save). An interrupted save
  never becomes the latest. ``training.save_checkpoint_and_time`` survives its timing collectives
  after the save like ``training_log`` does;
- ``training.evaluate_and_print_results``: evaluates with the rebuilt validation iterator.

``train()`` and ``pretrain()`` bind the model list, the optimizer and the LR scheduler once. After a
re-form they stay valid handles: the list's chunks are replaced; the optimizer object takes on the
rebuilt optimizer's class and attributes (so every reference to it sees the new state); the
scheduler already points at that object and keeps its own step count; the process-group collection
``train()`` took from the first chunk for its logging is updated in place; and Megatron's global
arguments (rank, world size, data-parallel size) and micro-batch calculator learn the new world.

What the Megatron loop does not carry yet is refused before anything starts (``unsupported_flags``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.resihp.logging_utils import EventLog, log_line
from megatron.resihp.model_builder import TrainingObjects
from megatron.resihp.run_state import StopTraining

# Megatron flags (as parsed) whose jobs the fail-stop path cannot yet carry through a re-form, and why.
_UNSUPPORTED = {
    "virtual_pipeline_model_parallel_size": ("--num-layers-per-virtual-pipeline-stage / "
                                             "--virtual-pipeline-model-parallel-size",
                                             "the interleaved schedule's model chunks are not rebuilt yet"),
    "context_parallel_size": ("--context-parallel-size", "context-parallel groups are not re-formed"),
    "expert_model_parallel_size": ("--expert-model-parallel-size", "expert-parallel groups are not re-formed"),
    "use_megatron_fsdp": ("--use-megatron-fsdp", "sharded parameters are not re-formed"),
    "use_torch_fsdp2": ("--use-torch-fsdp2", "sharded parameters are not re-formed"),
}
# Megatron flags that place ranks or layers otherwise than the launch Layout this loop builds.
_OTHER_PLACEMENT = {
    "use_tp_pp_dp_mapping": "--use-tp-pp-dp-mapping",
    "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
}
# --resihp-* settings that need the fail-slow detector, which runs on the resihp loop only for now.
_FAIL_SLOW_ONLY = ("detect_only", "trace", "verify_iters", "verify_margin")
# Phases a kill can wait for on this loop: a recovery's re-form and its rendezvous (its plans move no
# state), the iteration's log, and a save as it begins and once this rank's files are written
# (Megatron's save has no rename; its shutdown has no injection point yet).
_PHASES = (None, "reform", "rendezvous", "log", "save", "save-write")


def unsupported_flags(args: argparse.Namespace, cfg) -> list[str]:
    """What this job asks for that resilience on Megatron's loop cannot carry yet, one reason per
    item (empty: the job may run). ``args`` are Megatron's validated arguments, ``cfg`` the
    ``ResiHPConfig`` of its ``--resihp-*`` flags."""
    found = []
    for dest, (flag, why) in _UNSUPPORTED.items():
        value = getattr(args, dest, None)
        if value is True or (type(value) is int and value > 1):  # a switch that is on, a size above 1
            found.append(f"{flag} ({why})")
    for dest, flag in _OTHER_PLACEMENT.items():
        if getattr(args, dest, None) not in (None, False):
            found.append(f"{flag} (the groups and stages are rebuilt in the default rank order with equal layers per stage)")
    if args.num_layers % args.pipeline_model_parallel_size:
        found.append(f"--num-layers {args.num_layers} over --pipeline-model-parallel-size "
                     f"{args.pipeline_model_parallel_size} (stages are rebuilt with equal layers)")
    if getattr(args, "dataloader_type", "single") != "single":
        found.append(f"--dataloader-type {args.dataloader_type} (loaders are rebuilt for the 'single' type only)")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in _FAIL_SLOW_ONLY:
        if getattr(cfg, name) != defaults[name]:
            found.append(f"--resihp-{name.replace('_', '-')} (fail-slow detection runs on --resihp-loop resihp only)")
    for fault in cfg.faults:
        if fault.kind.value not in ("kill", "hang"):
            found.append(f"--resihp-inject {fault.spec()} (fail-slow faults are judged on --resihp-loop resihp only)")
        elif getattr(fault, "during", None) not in _PHASES:
            found.append(f"--resihp-inject {fault.spec()} (on this loop a kill can wait for the phases "
                         f"{', '.join(p for p in _PHASES if p)} only)")
    return found


class ResilientMegatronLoop:
    """The patches and the state they share: this process's executor and the loop's handles."""

    def __init__(self, cfg, model_provider, model_type):
        # Kept here, not on Megatron's arguments: those are saved into every checkpoint, which a
        # stock Megatron-LM must be able to load.
        self.cfg = cfg
        self.model_provider = model_provider
        self.model_type = model_type
        self.hooks = None  # ResilienceHooks, made at the first step (groups and objects exist then)
        self.events: EventLog | None = None
        self.loaders: list[tuple[object, int]] = []  # (dataset, consumed) in the order Megatron built them
        self.train_iterator = None  # rebuilt by a re-form; None: the loop's own
        self.valid_iterators = None
        self.forward_backward_func = None
        self.loop_groups = None  # the process-group collection train() took from the first chunk
        self.handles = None  # train()'s model list, optimizer and LR scheduler (kept valid across re-forms)
        self.saved: set[int] = set()  # iterations this process's world saved whole
        self._saved_generation = 0  # the world the checkpointing context's cached strategies belong to
        self._stepped = False
        self._original: dict[str, object] = {}

    # ------------------------------------------------------------------ patches
    def install(self) -> None:
        from megatron.core import parallel_state
        from megatron.training import training

        self._original = {
            "initialize_model_parallel": parallel_state.initialize_model_parallel,
            "train_step": training.train_step,
            "build_pretraining_data_loader": training.build_pretraining_data_loader,
            "evaluate_and_print_results": training.evaluate_and_print_results,
            "training_log": training.training_log,
            "save_checkpoint": training.save_checkpoint,
            "save_checkpoint_and_time": training.save_checkpoint_and_time,
        }
        parallel_state.initialize_model_parallel = self._initialize_model_parallel
        training.train_step = self.train_step
        training.build_pretraining_data_loader = self._build_data_loader
        training.evaluate_and_print_results = self._evaluate_and_print_results
        training.training_log = self._training_log
        training.save_checkpoint = self._save_checkpoint
        training.save_checkpoint_and_time = self._save_checkpoint_and_time

    def uninstall(self) -> None:
        from megatron.core import parallel_state
        from megatron.training import training

        for name, fn in self._original.items():
            setattr(parallel_state if name == "initialize_model_parallel" else training, name, fn)
        self._original = {}

    def _initialize_model_parallel(self, *args, **kwargs) -> None:
        """The launch Layout's groups, built by the one group builder and installed for megatron-core."""
        from megatron.training import get_args

        from megatron.resihp.parallel_state_patch import build_groups, install
        from resihp_ext.layout import Layout, ModelSpec

        margs = get_args()
        model = ModelSpec(
            num_layers=margs.num_layers, hidden_size=margs.hidden_size, num_attention_heads=margs.num_attention_heads,
            ffn_hidden_size=margs.ffn_hidden_size, vocab_size=getattr(margs, "padded_vocab_size", None) or margs.vocab_size,
            seq_length=margs.seq_length, micro_batch_size=margs.micro_batch_size,
            global_batch_size=margs.global_batch_size,
        )
        pp = margs.pipeline_model_parallel_size
        layout = Layout.uniform(model, margs.tensor_model_parallel_size, pp, margs.data_parallel_size,
                                (margs.num_layers // pp,) * pp)
        install(build_groups(layout, dist.get_rank(), timeout=self.cfg.collective_timeout_s))

    def _build_data_loader(self, dataset, consumed_samples):
        self.loaders.append((dataset, consumed_samples))
        return self._original["build_pretraining_data_loader"](dataset, consumed_samples)

    def _evaluate_and_print_results(self, prefix, forward_step_func, data_iterator, *args, **kwargs):
        if self.valid_iterators is not None:
            data_iterator = self.valid_iterators
        return self._original["evaluate_and_print_results"](prefix, forward_step_func, data_iterator, *args, **kwargs)

    # ------------------------------------------------------------------ the step
    def train_step(self, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        """Megatron's ``train_step`` with the heartbeat, injected faults and in-place recovery around it."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        if self.hooks is None:
            self._start(model, optimizer, opt_param_scheduler)
        number = iteration + 1  # the iteration being run, as Megatron logs it
        self.hooks.before_iteration(number, None, None)
        step = self._original["train_step"]
        start = time.perf_counter()
        while True:
            scheduler_steps = opt_param_scheduler.num_steps
            self._stepped = False
            try:
                result = step(forward_step_func, data_iterator if self.train_iterator is None else self.train_iterator,
                              model, optimizer, opt_param_scheduler, config,
                              self.forward_backward_func or forward_backward_func, iteration=iteration,
                              pg_collection=pg_collection,
                              p2p_communicator=None if self.forward_backward_func else p2p_communicator)
                break
            except RuntimeError as error:  # torch.distributed reports a dead or stuck peer this way
                if not self.hooks.can_recover:
                    raise
                stepped = self._stepped
                self._recover(number, error, stepped)
            if stepped:
                # This rank's replica stepped before the failure surfaced (its loss reduction failed):
                # the iteration is done; its loss is lost to the log.
                if opt_param_scheduler.num_steps == scheduler_steps:
                    opt_param_scheduler.step(increment=self._args().global_batch_size)
                result = {}, 0, False, False, 0, None, None, 0
                break
            machine = get_rerun_state_machine()  # the failed attempt left it mid-iteration
            machine.state = RerunState.NOT_RUNNING_YET
            machine.current_iteration -= 1
        self._record(number, result, time.perf_counter() - start)
        return result

    def _training_log(self, loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                      *args, **kwargs):
        """Megatron's ``training_log`` for ``iteration``, survived when its world-wide collectives fail."""
        from megatron.training import training

        log = self._original["training_log"]
        call = (loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag, *args)
        if self.hooks is None or not self.hooks.can_recover:
            return log(*call, **kwargs)
        self.hooks.inject(iteration, "log")
        totals = dict(total_loss_dict)  # its values are replaced, never changed in place
        printed = []
        print_rank_last = training.print_rank_last
        training.print_rank_last = lambda message: (printed.append(dist.get_rank() == dist.get_world_size() - 1),
                                                    print_rank_last(message))
        try:
            return log(*call, **kwargs)
        except RuntimeError as error:  # a peer died or hung in the barrier or the timers' all-gather
            if not self.hooks.can_recover:
                raise
            self._recover(iteration, error, stepped=True)
            if any(printed) or dist.get_rank() != dist.get_world_size() - 1:
                return report_memory_flag
            # This process prints for the re-formed world: the line, without its collectives (no
            # other rank runs them now).
            total_loss_dict.clear()
            total_loss_dict.update(totals)
            with _alone():
                return log(*call, **kwargs)
        finally:
            training.print_rank_last = print_rank_last

    def _save_checkpoint(self, iteration, *args, **kwargs):
        """Megatron's ``save_checkpoint`` of ``iteration``, survived when a rank fails during it."""
        save = self._original["save_checkpoint"]
        if self.hooks is None or not self.hooks.can_recover:
            return save(iteration, *args, **kwargs)
        if iteration in self.saved:
            # Megatron saves again at an iteration it just saved (a periodic save right after the one
            # a change of the micro-batch count asks for): the checkpoint is whole already, and a
            # failure while its files were rewritten could not be told from one before they were.
            log_line(f" resihp: iteration {iteration} is saved already; not saving it again")
            return None
        call = inspect.signature(save).bind(iteration, *args, **kwargs)
        tracker = Path(self._args().save) / "latest_checkpointed_iteration.txt"
        latest_before = _read(tracker)
        self.hooks.inject(iteration, "save")
        while True:
            self._refresh_save_groups(call)
            try:
                with self._faults_in_save(iteration):
                    result = save(*call.args, **call.kwargs)
                self.saved.add(iteration)
                return result
            except RuntimeError as error:  # a peer died or hung in one of the save's collectives
                if not self.hooks.can_recover:
                    raise
                self._recover(iteration, error, stepped=True)
            if _read(tracker) == str(iteration) and latest_before != str(iteration):
                log_line(f" resihp: the checkpoint of iteration {iteration} was whole when the failure came")
                self.saved.add(iteration)
                return None
            log_line(f" resihp: saving iteration {iteration} again, on the re-formed world")

    def _refresh_save_groups(self, call: inspect.BoundArguments) -> None:
        """A save after a re-form uses the new world's groups: the ones ``save_checkpoint_and_time``
        read from the model before the failure are gone, and the checkpointing context caches a
        save strategy built on the old data-parallel group."""
        from megatron.core.utils import unwrap_model

        generation = self.hooks.run.generation
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
        """``during=save-write`` kills: the save's first barrier is the one after this rank's files."""
        if not any(f.during == "save-write" for f in self.hooks.faults):
            yield
            return
        barrier = dist.barrier
        calls = []

        def first_barrier_kills(*args, **kwargs):
            if not calls:
                calls.append(True)
                self.hooks.inject(iteration, "save-write")
            return barrier(*args, **kwargs)

        dist.barrier = first_barrier_kills
        try:
            yield
        finally:
            dist.barrier = barrier

    def _save_checkpoint_and_time(self, iteration, *args, **kwargs):
        """Megatron's ``save_checkpoint_and_time``: after the save (survived in ``_save_checkpoint``)
        it logs the save's time over the world and restarts the interval timer with a barrier; a
        failure there leaves a whole checkpoint, and the survivors go on after ``iteration``."""
        from megatron.training.global_vars import get_timers

        outer = self._original["save_checkpoint_and_time"]
        if self.hooks is None or not self.hooks.can_recover:
            return outer(iteration, *args, **kwargs)
        try:
            return outer(iteration, *args, **kwargs)
        except RuntimeError as error:
            if not self.hooks.can_recover:
                raise
            self._recover(iteration, error, stepped=True)
            interval = get_timers()("interval-time", log_level=0)
            if not interval._started:  # its barrier failed before it started
                interval.start()
            return None

    def _record(self, number: int, result, elapsed_s: float) -> None:
        """The iteration's event, from the last rank (Megatron's loss is reported on the last stage)."""
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        loss = result[0].get("lm loss")
        args = self._args()
        self.events.emit("iteration", number, lm_loss=None if loss is None else float(loss), elapsed_s=elapsed_s,
                         consumed_samples=args.consumed_train_samples + args.global_batch_size,
                         grad_norm=None if result[5] is None else float(result[5]))

    def _args(self):
        from megatron.training import get_args

        return get_args()

    def _start(self, model, optimizer, opt_param_scheduler) -> None:
        from megatron.core.utils import get_attr_wrapped_model, get_model_config

        from megatron.resihp.resilience import ResilienceHooks

        args = self._args()
        self.handles = (model, optimizer, opt_param_scheduler)
        self.loop_groups = get_attr_wrapped_model(model[0], "pg_collection")
        objects = TrainingObjects(get_model_config(model[0]), model[0], optimizer, opt_param_scheduler,
                                  (args.num_layers // args.pipeline_model_parallel_size,) * args.pipeline_model_parallel_size)
        self.events = EventLog(self.cfg.event_log, dist.get_rank())
        self.hooks = ResilienceHooks(args, self.events, objects, build_objects=self._build_objects,
                                     detect_fail_slow=False, moves_state=False,
                                     sharded_optimizer=args.use_distributed_optimizer, cfg=self.cfg,
                                     stands_by=False)
        self._watch_steps(optimizer)
        self.events.emit("start", args.iteration, world_size=dist.get_world_size(), loop="megatron",
                         layers_per_stage=list(objects.layers_per_stage))
        if dist.get_rank() == dist.get_world_size() - 1:
            log_line(" resihp: on Megatron-LM's loop: heartbeats on, fail-stop recovery in place "
                     f"{'on' if self.hooks.can_recover else 'off (--resihp-enable turns it on)'}; fail-slow "
                     "detection runs on --resihp-loop resihp")

    def _watch_steps(self, optimizer) -> None:
        """Note when this rank's optimizer step returns: a failure after it must not redo the iteration."""
        inner = type(optimizer).step

        def step(*args, **kwargs):
            result = inner(optimizer, *args, **kwargs)
            self._stepped = True
            return result

        optimizer.step = step

    def _build_objects(self, args, layers_per_stage) -> TrainingObjects:
        """Megatron's own model chunks, optimizer and LR schedule on the installed groups."""
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.utils import get_model_config
        from megatron.training.global_vars import get_timers
        from megatron.training.training import get_megatron_optimizer_config, get_model, get_optimizer_param_scheduler

        launch = (args.num_layers // args.pipeline_model_parallel_size,) * args.pipeline_model_parallel_size
        if tuple(layers_per_stage) != launch:
            raise RuntimeError(f"layers per stage {list(layers_per_stage)} differ from the launch's {list(launch)}; "
                               "Megatron's loop rebuilds the launch's stages only")
        chunks = get_model(self.model_provider, self.model_type)
        config, overrides = get_megatron_optimizer_config(args)
        config.timers = get_timers()
        optimizer = get_megatron_optimizer(config, chunks, config_overrides=overrides,
                                           use_gloo_process_groups=args.use_gloo_process_groups)
        return TrainingObjects(get_model_config(chunks[0]), chunks[0], optimizer,
                               get_optimizer_param_scheduler(optimizer), tuple(layers_per_stage))

    # ------------------------------------------------------------------ recovery
    def _recover(self, number: int, error: Exception, stepped: bool) -> None:
        """Recover from ``error`` at iteration ``number`` (done when this rank had ``stepped``), or leave."""
        args = self._args()
        old_config = self.hooks.run.objects.config
        try:
            self.hooks.recover(number, error, self.hooks.run.objects, args.consumed_train_samples,
                               list(self.hooks.run.quotas), completed=number if stepped else None)
        except StopTraining as stop:
            log_line(f" resihp: rank leaving at iteration {number}: {stop}")
            self.events.emit("exit", number, exit_code=stop.exit_code, reason=str(stop))
            self.events.close()
            sys.exit(stop.exit_code)
        self._take_over(*self.handles, old_config)

    def _take_over(self, model, optimizer, opt_param_scheduler, old_config) -> None:
        """Make the loop's handles the re-formed world's objects, and Megatron's globals its size."""
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator, init_num_microbatches_calculator,
        )
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_attr_wrapped_model

        args = self._args()
        new = self.hooks.run.objects
        # The optimizer train() holds becomes the rebuilt one; the scheduler it holds drives it.
        optimizer.__class__ = type(new.optimizer)
        optimizer.__dict__ = dict(new.optimizer.__dict__)
        self._watch_steps(optimizer)
        model[:] = [new.model]
        config = new.config
        for name in ("timers", "finalize_model_grads_func"):
            setattr(config, name, getattr(old_config, name))
        config.grad_scale_func = optimizer.scale_loss
        if args.overlap_grad_reduce:
            config.no_sync_func = model[0].no_sync
            if args.align_grad_reduce:
                config.grad_sync_func = model[0].start_grad_sync
        if args.overlap_param_gather and args.align_param_gather:
            config.param_sync_func = model[0].start_param_sync
        self.hooks.run = self.hooks.run.replace(
            objects=dataclasses.replace(new, optimizer=optimizer, scheduler=opt_param_scheduler))
        vars(self.loop_groups).update(vars(get_attr_wrapped_model(model[0], "pg_collection")))
        self.forward_backward_func = get_forward_backward_func()
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        args.data_parallel_size = parallel_state.get_data_parallel_world_size()
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                         args.data_parallel_size, args.decrease_batch_size_if_needed)
        self._rebuild_iterators(args)

    def _rebuild_iterators(self, args) -> None:
        """Loaders for the new data-parallel rank and size, at the samples already consumed (the
        sampler reads both from the installed groups). The default generator is left where it was:
        on a CPU it is also dropout's."""
        from megatron.core.rerun_state_machine import RerunDataIterator

        build = self._original["build_pretraining_data_loader"]
        state = torch.get_rng_state()
        try:
            train = self.loaders[0][0] if self.loaders else None
            self.train_iterator = RerunDataIterator(iter(build(train, args.consumed_train_samples))) \
                if train is not None else None
            valid = [d for d, _ in self.loaders[1:2] if d is not None]
            self.valid_iterators = RerunDataIterator(iter(build(valid[0], args.consumed_valid_samples))) \
                if valid else None
        finally:
            torch.set_rng_state(state)

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.close()
        if self.events is not None:
            self.events.close()


def _read(path: Path) -> str | None:
    """A tracker file's text (None when there is none)."""
    try:
        return path.read_text().strip()
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
