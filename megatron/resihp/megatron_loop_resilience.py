"""Resilience inside Megatron-LM's own training loop (the loop every job runs on).

Responsible for the patch points of megatron-core 0.19.2's ``megatron.training`` through which this
process's executor (``ResilienceHooks``, its fail-stop driver and the one life cycle,
``reconfigure.apply``) runs inside Megatron's ``train()``:

- ``parallel_state.initialize_model_parallel``: the launch Layout's groups, made by
  ``parallel_state_patch.build_groups`` (their memberships equal megatron-core's), so that a later
  re-form can replace them;
- ``training.train_step``: every iteration beats the heartbeat and applies injected faults (a
  ``raise:`` fault strikes inside the step: ``raised_faults``), then runs Megatron's own step on
  the current objects, its forwards and backwards timed by the schedule hooks
  (``schedules.RECORDER``). After the step the detector judges the timings; a fail-slow verdict
  is planned for: micro-batches move between replicas (which ``megatron_loop_quotas`` makes
  Megatron's step run), layers between stages, each replica in a split of its own or, where the
  job's features need it, one split for all (``megatron_loop_stages``), a very slow rank leaves its
  TP group (its replica going on at a smaller degree), or a very slow replica is dropped whole,
  the ranks left out standing by; a
  re-plan that kept every rank is on trial (verified, and undone when it does not pay); a rebuilt model is taken
  over before the next step. At the top of each step, standbys that report healthy are taken
  back when it pays (``standby.Readmission``). When a collective fails, the
  survivors agree on a plan and re-form in place (a stage group that lost ranks may run its
  replica at a smaller TP degree, the replicas numbered largest degree first); the same iteration
  then runs again on the new world, or, when this rank's optimizer had already stepped, counts as
  done;
- ``training.train``: a rank a plan leaves out stands by outside it, and enters it again when a
  later recovery gives it a dead rank's place, or a readmission takes it back
  (``megatron_loop_spares``);
- ``training.build_pretraining_data_loader``: remembers the datasets, so that a re-formed world's
  loaders are rebuilt at the samples already consumed, for the new data-parallel rank and size
  (TP rank 0 of each group reads; the others hold the datasets for a later TP 1);
- ``checkpointing.generate_state_dict``: in a world at two TP degrees, the smaller replicas' ranks
  hand no shared shards to a ``torch_dist`` save (``mixed_tp_saves``);
- the phases between two steps (the log, the evaluation, the save) and the timers' barriers
  around them: ``megatron_loop_phases.BetweenSteps``, which also agrees, after every re-form,
  where the loop stands;

``train()`` and ``pretrain()`` bind the model list, the optimizer and the LR scheduler once. After a
re-form they stay valid handles (``megatron_loop_handles``); the scheduler already points at the
optimizer object and keeps its own step count; the process-group collection ``train()`` took from
the first chunk for its logging is updated in place; and Megatron's global arguments (rank, world
size, data-parallel size) and micro-batch calculator learn the new world (a data-parallel size that
divides the global batch: ``megatron_loop_replicas``).

What the Megatron loop does not carry yet is refused before anything starts
(``megatron_loop_support.unsupported_flags``).
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import torch.distributed as dist

from megatron.resihp import megatron_loop_quotas as quota_split
from megatron.resihp import mixed_tp_saves, packed_documents
from megatron.resihp.async_saves import AsyncSaves
from megatron.resihp.data_samplers import even_quotas
from megatron.resihp.detection_cost import AlternateDetection
from megatron.resihp.logging_utils import EventLog, log_line, process_threads
from megatron.resihp.megatron_loop_counts import MicrobatchCount
from megatron.resihp.megatron_loop_data import LoopData
from megatron.resihp.megatron_loop_handles import adopt
from megatron.resihp.megatron_loop_phases import BetweenSteps, Phase, Position
from megatron.resihp.megatron_loop_replicas import CountedSplit
from megatron.resihp.megatron_loop_spares import SpareReentry
from megatron.resihp.megatron_loop_stages import (build_objects, interleaving, launch_chunks, launch_split,
                                                  layer_moves_refused, own_splits_refused, tp_shrink_refused)
from megatron.resihp.training_objects import TrainingObjects
from megatron.resihp.megatron_loop_updates import UpdateWatch
from megatron.resihp.memory_facts import memory_line
from megatron.resihp.optimizer_parts import PartCopies, part_bytes
from megatron.resihp.raised_faults import RaisedFaults
from megatron.resihp.run_state import StopTraining, leave_process
from megatron.resihp.schedules import RECORDER, StepTimings, install_hooks
from megatron.resihp.standby import StandingBy
from megatron.resihp.world_abort import forget_rank_sockets

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
        self.data: LoopData | None = None  # made as the patches go in (it builds with Megatron's builder)
        self.forward_backward_func = None
        self.loop_groups = None  # the process-group collection train() took from the first chunk
        self.handles = None  # train()'s model list, optimizer and LR scheduler (kept valid across re-forms)
        self.phases = BetweenSteps(self)
        self.saves = AsyncSaves(self)  # --async-save saves still being written when the world changes
        self.spares = SpareReentry(self)
        self.counts = MicrobatchCount()
        self.split = CountedSplit(lambda: (self.hooks.run.replica, self.hooks.run.data_parallel_size))
        self.updates = UpdateWatch(self)  # whether this rank's optimizer updated in the step running
        self._original: dict[str, object] = {}
        self._quotas_in_use: tuple[int, ...] | None = None  # what the loader, count and loss scale follow
        self._microbatches: int | None = None  # this replica's count when quotas are uneven
        self.alternate = AlternateDetection.from_environment()  # measuring detection's cost, or None

    # ------------------------------------------------------------------ patches
    def install(self) -> None:
        from megatron.core import parallel_state
        from megatron.training import training

        self._original = {
            "initialize_model_parallel": parallel_state.initialize_model_parallel,
            "train": training.train,
            "train_step": training.train_step,
            "build_pretraining_data_loader": training.build_pretraining_data_loader,
        }
        self.data = LoopData(self._loader)
        parallel_state.initialize_model_parallel = self._initialize_model_parallel
        training.train = self._train
        training.train_step = self.train_step
        training.build_pretraining_data_loader = self._build_data_loader
        self.phases.install()
        self.saves.install()
        self.spares.install()
        self.split.install()
        mixed_tp_saves.install()

    def uninstall(self) -> None:
        from megatron.core import parallel_state
        from megatron.training import training

        for name, fn in self._original.items():
            setattr(parallel_state if name == "initialize_model_parallel" else training, name, fn)
        self._original = {}
        self.phases.uninstall()
        self.saves.uninstall()
        self.spares.uninstall()
        self.split.uninstall()
        mixed_tp_saves.uninstall()

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
            global_batch_size=margs.global_batch_size, launch_chunks=launch_chunks(margs),
        )
        pp = margs.pipeline_model_parallel_size
        layout = Layout.uniform(model, margs.tensor_model_parallel_size, pp, margs.data_parallel_size,
                                launch_split(margs))
        install(build_groups(layout, dist.get_rank(), timeout=self.cfg.collective_timeout_s))
        if margs.virtual_pipeline_model_parallel_size is not None:  # as megatron-core's own initialization
            from megatron.core import parallel_state

            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
            parallel_state.set_virtual_pipeline_model_parallel_world_size(margs.virtual_pipeline_model_parallel_size)
        if self.hooks is None:
            self._start_hooks(margs)

    def _train(self, *args, **kwargs):
        """Megatron's ``train()``, entered again by a spare taken back (``megatron_loop_spares``); the
        validation iterator it is given is noted, to tell its evaluations from the test set's."""
        original = self._original["train"]
        self.data.loop_valid = inspect.signature(original).bind(*args, **kwargs).arguments.get("valid_data_iterator")
        return self.spares.train(original, *args, **kwargs)

    def _build_data_loader(self, dataset, consumed_samples):
        from megatron.core import parallel_state

        if not self.data.datasets:
            self.hooks.inject(self._args().iteration + 1, "setup")
        self.data.built(dataset)
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            return None  # opened for a later TP-1 replica (``shrinks_tp``); TP rank 0 reads for its group
        return self._loader(dataset, consumed_samples)

    def shrinks_tp(self, args) -> bool:
        """Whether a stage group that loses ranks may go on at a smaller TP degree (under the
        distributed optimizer, with every replica): then every TP rank of the first and last
        stages opens the data, which any of them may have to read."""
        return self.cfg.enable and tp_shrink_refused(args) is None

    def _loader(self, dataset, consumed_samples):
        """Megatron's loader, its workers holding no copy of this rank's connections (``world_abort``)."""
        return forget_rank_sockets(self._original["build_pretraining_data_loader"](dataset, consumed_samples))

    # ------------------------------------------------------------------ the step
    def train_step(self, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        """Megatron's ``train_step`` with the heartbeat, injected faults and in-place recovery around it."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        if self.handles is None:
            self._start(model, optimizer, opt_param_scheduler)
            self.data.loop_train = data_iterator
        number = iteration + 1  # the iteration being run, as Megatron logs it
        self.spares.entering = False
        self.phases.enter(Position(number, Phase.STEP))  # a step is never skipped: nobody is past it
        self.counts.at_step(number)
        self._first_copies(number)
        try:
            self.hooks.before_iteration(number, None, None)
        except StopTraining as stop:  # the job's store is gone
            self.leave(number, stop)
        self._check_standbys(number)
        step = self._original["train_step"]
        detecting = self.alternate is None or self.alternate.begin(number)
        start = time.perf_counter()
        while True:
            scheduler_steps = opt_param_scheduler.num_steps
            self.updates.stepped = False
            result = None
            self._follow_quotas(self._args().consumed_train_samples)
            fb = self.forward_backward_func or forward_backward_func
            if self._microbatches is not None:
                fb = quota_split.with_microbatches(fb, self._microbatches)
            try:
                RECORDER.start_iteration()
                try:
                    result = step(self.raised.forward_step(forward_step_func, number),
                                  data_iterator if self.data.train_iterator is None else self.data.train_iterator,
                                  model, optimizer, opt_param_scheduler, config, fb, iteration=iteration,
                                  pg_collection=pg_collection,
                                  p2p_communicator=None if self.forward_backward_func else p2p_communicator)
                finally:
                    RECORDER.active = False
                before, replicas = self.hooks.run.objects, self.hooks.run.data_parallel_size
                try:
                    if detecting:
                        self._judge(number, time.perf_counter() - start)
                except StandingBy:  # a re-plan dropped this rank's replica: out of train() (``spares``)
                    raise
                except StopTraining as stop:  # ... and this rank does not stand by
                    self.leave(number, stop)
                if self.hooks.run.objects is not before:  # a re-plan moved layers or dropped replicas
                    args = self._args()
                    self.take_over(*self.handles, before.config, args.consumed_train_samples + args.global_batch_size)
                    if self.hooks.run.data_parallel_size != replicas:
                        self.counts.count_now()  # train() saves at the next iteration's top, as after a re-form
                break
            except RuntimeError as error:  # torch.distributed reports a dead or stuck peer this way
                if not self.hooks.can_recover:
                    raise
                self.recover_at(Position(number, Phase.STEPPED if self.updates.stepped else Phase.STEP), error)
            # A recovery that took this rank's update back (``stage_parts``) runs the iteration again.
            stepped = self.updates.stepped
            if not stepped and opt_param_scheduler.num_steps != scheduler_steps:
                opt_param_scheduler.num_steps = scheduler_steps
                opt_param_scheduler.step(increment=0)  # the learning rate of the step not taken
            if stepped:
                # This rank's replica stepped before the failure surfaced (in its loss reduction, or
                # while the detector judged the step): the iteration is done; its loss may be lost to
                # the log.
                if opt_param_scheduler.num_steps == scheduler_steps:
                    opt_param_scheduler.step(increment=self._args().global_batch_size)
                result = result or ({}, 0, False, False, 0, None, None, 0)
                break
            machine = get_rerun_state_machine()  # the failed attempt left it mid-iteration
            machine.state = RerunState.NOT_RUNNING_YET
            machine.current_iteration -= 1
        if self.hooks.run.part_copies is not None:
            self.hooks.run.part_copies.step_done()
        self._record(number, result, time.perf_counter() - start)
        self.split.after_step(self._args())
        return result

    def _check_standbys(self, number: int) -> None:
        """At the top of step ``number``: standbys follow the job's iteration, and those a fail-slow
        re-plan left out are taken back when they report healthy and it pays (``Readmission``); the
        loop then runs the grown world's objects, and agrees with the joiners where it stands."""
        hooks = self.hooks
        before = hooks.run.objects
        try:
            hooks.readmission.check_standbys(number, self._args().consumed_train_samples)
        except RuntimeError as error:  # a member failed before the grown world had its state
            if not hooks.can_recover:
                raise
            self.recover_at(Position(number, Phase.STEP), error)
            return
        if hooks.run.objects is before:
            return
        self.take_over(*self.handles, before.config, self._args().consumed_train_samples)
        self.phases.agree()  # with the joiners (``SpareReentry``), which learn the loop's counters from it
        self.counts.count_now()

    def _first_copies(self, number: int) -> None:
        """The launch world's first copies of the optimizer's parts, before anything else of its first
        step (a failure then finds them; later worlds make theirs as they form)."""
        copies = self.hooks.run.part_copies
        if copies is None or copies.held is not None or copies.holder is None:
            return
        try:
            copies.send()
        except RuntimeError as error:  # a peer lost before its first copies: no in-place plan
            if not self.hooks.can_recover:
                raise
            self.recover_at(Position(number, Phase.STEP), error)

    def _judge(self, number: int, elapsed_s: float) -> None:
        """The detector judges iteration ``number``'s timings (every rank: it gathers them); a
        fail-slow verdict may change the quotas, which the next step follows."""
        if self.hooks.live is None:
            return
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        RECORDER.collect()
        args = self._args()
        # Attention kept within packed documents costs what the forward steps recorded per
        # micro-batch; otherwise the square of the sequence per sample whatever documents it packs,
        # the same features for every micro-batch: (tokens, sum of squares, samples), one per op
        # column (under the interleaved schedule, one per model chunk's op).
        mbs, seq = args.micro_batch_size, args.seq_length
        columns = (self._microbatches or get_num_microbatches()) * self.hooks.interleaving.num_chunks
        features = packed_documents.recorded_features(columns, self.hooks.interleaving.num_chunks) if packed_documents.document_attention(args) else None
        timings = StepTimings(ops=list(RECORDER.ops), busy=list(RECORDER.busy),
                              features=features or [(mbs * seq, mbs * seq * seq, mbs)] * columns,
                              iteration_s=time.perf_counter() - RECORDER.iteration_start_s)
        self.hooks.after_iteration(number, elapsed_s, timings, self.hooks.run.objects, list(self.hooks.run.quotas))

    def _follow_quotas(self, consumed: int) -> None:
        """Make Megatron's step run the run's quotas (``megatron_loop_quotas``), from ``consumed``
        samples on, when they are not the ones it runs."""
        run = self.hooks.run
        if run.quotas == self._quotas_in_use:
            return
        uneven = quota_split.uneven(run.quotas)
        config = run.objects.config
        factor = quota_split.loss_factor(run.quotas, run.replica, config.calculate_per_token_loss) if uneven else 1.0
        config.grad_scale_func = quota_split.scaled_loss(self.handles[1].scale_loss, factor)
        # Megatron's calculator runs its own even split of the batch over ``args.data_parallel_size``
        # replicas; a grown world keeps the smaller count it had (``CountedSplit.set_world``).
        args = self._args()
        megatron_count = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        self._microbatches = run.quotas[run.replica] if uneven or run.quotas[run.replica] != megatron_count else None
        self.data.rebuild(args, run, consumed, train_only=self._quotas_in_use is not None)
        self._quotas_in_use = run.quotas

    def _record(self, number: int, result, elapsed_s: float) -> None:
        """The iteration's event, from the last rank (Megatron's loss is reported on the last stage)."""
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        loss = result[0].get("lm loss")
        args = self._args()
        measured = {} if self.alternate is None else self.alternate.measured(self.hooks.probe_rounds_run())
        self.events.emit("iteration", number, lm_loss=None if loss is None else float(loss), elapsed_s=elapsed_s,
                         consumed_samples=args.consumed_train_samples + args.global_batch_size,
                         grad_norm=None if result[5] is None else float(result[5]), **measured)

    def _args(self):
        from megatron.training import get_args

        return get_args()

    def _start_hooks(self, args) -> None:
        """This process's executor, as soon as the launch world's groups exist: its heartbeats then
        watch Megatron's set-up too (model build, checkpoint load, data loaders), so that a rank
        lost before the first step is named (``megatron_loop_setup.leave_before_training``)."""
        from megatron.resihp.resilience import ResilienceHooks

        self.events = EventLog(self.cfg.event_log, dist.get_rank())
        install_hooks()  # the detector's timings (and injected slowdowns) of every forward and backward
        RECORDER.use_device(args.device, args.cpu_device_time_scale)
        # A rank a fail-stop plan leaves out stands by as a spare (``spares``). Under the distributed
        # optimizer fail-stop plans move no weights (the parts and their copies carry the state). A
        # fail-slow plan may drop slow replicas down to any count a fail-stop plan may keep, their
        # ranks standing by and probing (under the interleaved schedule too: the counts whose
        # replicas each run whole groups of micro-batches).
        counts = quota_split.replica_counts(args)
        # Layers move between stages where a save after the move loads in a stock run; each replica
        # takes a split of its own where the layer-wise gradient sync carries the job's features.
        moves = layer_moves_refused(args) is None
        own_splits = moves and own_splits_refused(args) is None
        self.hooks = ResilienceHooks(args, self.events, build_objects=self._build_objects,
                                     sharded_optimizer=args.use_distributed_optimizer, cfg=self.cfg,
                                     stands_by=True, stages_alike=moves and not own_splits, own_splits=own_splits,
                                     recovery_keeps_shape=not args.use_distributed_optimizer,
                                     shrinks_tp=self.shrinks_tp(args) and own_splits_refused(args) is None,
                                     shrinks_every_replica=self.shrinks_tp(args) and args.use_distributed_optimizer,
                                     replica_counts=counts, interleaving=interleaving(args), fail_slow_drops=counts)
        self.hooks.saves = self.saves

    def _start(self, model, optimizer, opt_param_scheduler) -> None:
        """At the first step: the loop's handles and objects become the run's."""
        from megatron.core.utils import get_attr_wrapped_model, get_model_config

        args = self._args()
        self.handles = (model, optimizer, opt_param_scheduler)
        self.phases.start()
        self.loop_groups = get_attr_wrapped_model(model[0], "pg_collection")
        objects = TrainingObjects(get_model_config(model[0]), tuple(model), optimizer, opt_param_scheduler,
                                  launch_split(args))
        # Megatron's loop starts with micro-batches split evenly, and its own loader, count and scale run it.
        self.hooks.run = self.hooks.run.replace(objects=objects, quotas=tuple(even_quotas(
            args.global_batch_size // args.micro_batch_size, self.hooks.run.data_parallel_size)))
        self._quotas_in_use = self.hooks.run.quotas
        if args.use_distributed_optimizer and self.hooks.can_recover:
            # Each rank's part of the optimizer state is copied on the next rank of its position after
            # every update, so that a dead rank's part survives (``optimizer_parts``).
            self.hooks.run = self.hooks.run.replace(part_copies=PartCopies(self.hooks.run.layout, self.hooks.run.rank,
                                                                           optimizer))
        self.raised = RaisedFaults(self.hooks.faults, self.events, self.hooks.me)
        self.updates.watch(optimizer)
        copies = self.hooks.run.part_copies
        self.events.emit("start", args.iteration, world_size=dist.get_world_size(), loop="megatron",
                         layers_per_stage=list(objects.layers_per_stage),
                         optimizer_part_bytes=None if copies is None else part_bytes(optimizer),
                         threads=process_threads())
        if dist.get_rank() == dist.get_world_size() - 1:
            on = "on" if self.hooks.can_recover else "off (--resihp-enable turns it on)"
            kept, alike = layer_moves_refused(args), own_splits_refused(args)
            excluded = self.hooks.shrinks_tp  # ``shrinks_tp`` holds only with --resihp-enable
            replans = "off" if not self.cfg.enable else "of the micro-batch split" + (
                f"{'' if excluded else ' only'} (layers stay on their stages: {kept})" if kept
                else " and of the layers per stage" + (
                    f", one split for every replica ({alike})" if alike else ", a split of each replica's own"))
            if excluded:
                replans += ", and a very slow rank left out of its TP group (its replica at a smaller degree)"
            if self.hooks.can_recover:
                narrower = tp_shrink_refused(args)
                on += (f", every replica at TP {args.tensor_model_parallel_size} ({narrower})" if narrower is not None
                       else ", a stage group that lost ranks taking every replica to one smaller TP degree where "
                            "that beats going on without its replica" if args.use_distributed_optimizer
                       else ", a stage group that lost ranks going on at a smaller TP degree")
            detection = "on" if self.hooks.live is not None else "off"
            log_line(f" resihp: on Megatron-LM's loop: heartbeats on, fail-stop recovery in place {on}; fail-slow "
                     f"detection {detection}" + (f", re-plans {replans}" if self.hooks.live is not None else ""))
            if self.cfg.enable:
                log_line(memory_line(self.hooks.calibrated_hardware(), self.hooks.launch_layout))

    def _build_objects(self, args, layers_per_stage) -> TrainingObjects:
        """Megatron's own model chunks, optimizer and LR schedule on the installed groups, at this
        rank's replica's TP degree (replicas that differ have their gradients summed layer by layer,
        not by megatron-core's DDP)."""
        from megatron.resihp.parallel_state_patch import installed

        layout = installed().layout
        replica, stage = layout.stage_of(dist.get_rank())
        return build_objects(self.model_provider, self.model_type, args, tuple(layers_per_stage),
                             ddp_syncs=layout.replicas_alike(),
                             tp_degree=layout.replicas[replica].stages[stage].tp_degree)

    # ------------------------------------------------------------------ recovery
    def recover_at(self, position: Position, error: Exception) -> Position:
        """Recover from ``error``, which surfaced at ``position`` (the iteration is done from its
        optimizer step on), or leave; then agree with the other survivors where the loop stands.

        Returns:
            The furthest position any survivor stood at, which every survivor goes on from.
        """
        self.phases.position = position
        args = self._args()
        # Megatron counts an iteration's samples once its train_step returns: inside the step, after
        # this rank's optimizer stepped, they are consumed but not yet counted.
        uncounted = args.global_batch_size if position.phase is Phase.STEPPED else 0
        if self._recover(position.iteration, error, position.phase >= Phase.STEPPED, args.consumed_train_samples,
                         uncounted):
            self.updates.stepped = False
            self.phases.position = Position(position.iteration, Phase.STEP)
        furthest = self.phases.agree()
        # The re-form changes Megatron's micro-batch count: a rank an iteration behind takes it up
        # as it enters the step the furthest survivor stood in (``megatron_loop_counts``).
        if furthest.iteration > position.iteration:
            self.counts.count_anew_at(furthest.iteration)
        else:
            self.counts.count_now()
        return furthest

    def _recover(self, number: int, error: Exception, stepped: bool, counted: int, uncounted: int) -> bool:
        """Recover from ``error`` at iteration ``number`` (done when this rank had ``stepped``; Megatron
        has counted ``counted`` samples, and the step consumed ``uncounted`` more), or leave.

        Returns:
            Whether the recovery took this rank's optimizer update back (only ever inside the step,
            ``PartCopies.step_done``): the iteration runs again.
        """
        consumed = counted + uncounted
        old_config = self.hooks.run.objects.config
        updates = self.hooks.run.part_copies.updates if self.hooks.run.part_copies is not None else None
        try:
            self.hooks.recover(number, error, self.hooks.run.objects, consumed,
                               list(self.hooks.run.quotas), completed=number if stepped else None)
        except StandingBy:  # a spare: out of train() until a later failure calls it back (``_train``)
            raise
        except StopTraining as stop:
            self.leave(number, stop)
        copies = self.hooks.run.part_copies
        undone = stepped and updates is not None and copies is not None and copies.updates < updates
        self.take_over(*self.handles, old_config, consumed - uncounted if undone else consumed)
        return undone

    def leave(self, number: int, stop: StopTraining) -> None:
        """This rank leaves the job at iteration ``number``, as ``stop`` says."""
        log_line(f" resihp: {self.hooks.me} leaving at iteration {number}: {stop}")
        self.events.emit("exit", number, exit_code=stop.exit_code, reason=str(stop))
        self.events.close()
        leave_process(stop.exit_code)

    def take_over(self, model, optimizer, opt_param_scheduler, old_config, consumed: int) -> None:
        """Make the loop's handles the re-formed world's objects, and Megatron's globals its size."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_attr_wrapped_model

        args = self._args()
        new = self.hooks.run.objects
        adopt(model, optimizer, new, old_config, args)
        self.updates.watch(optimizer)
        self.hooks.run = self.hooks.run.replace(
            objects=dataclasses.replace(new, optimizer=optimizer, scheduler=opt_param_scheduler))
        vars(self.loop_groups).update(vars(get_attr_wrapped_model(model[0], "pg_collection")))
        self.forward_backward_func = get_forward_backward_func()
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        # The layout's replica count: a rank at a TP rank a smaller-TP replica lacks has fewer in its
        # data-parallel group (``parallel_state_patch``), and every rank must count alike.
        self.split.set_world(args, self.hooks.run.data_parallel_size)
        self._quotas_in_use = None  # a new world: its loaders, count and scale are made anew
        self._follow_quotas(consumed)

    def close(self) -> None:
        """As ``pretrain()`` returns: training, its last save and evaluation are done."""
        if self.hooks is not None:
            self.hooks.inject(self.phases.position.iteration, "shutdown")
            self.hooks.close()
        if self.events is not None:
            self.events.emit("finish", self.phases.position.iteration,
                             world_size=dist.get_world_size() if dist.is_initialized() else None,
                             threads=process_threads())
            self.events.close()
