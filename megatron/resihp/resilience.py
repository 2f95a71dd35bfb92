"""The training loop's resilience hooks: the executor of one process, between iterations.

Responsible for what ``resihp_ext`` decides being carried out at iteration boundaries: striking
injected faults on this process (``injected_faults.py``), feeding op timings to the
detector and logging its suspicions and verdicts, watching the world's heartbeats, and holding
the run (``RunState``) that layout changes replace. Which change to make is each driver's:
fail-slow re-plans in ``fail_slow_replan.py``, fail-stop recovery in ``fail_stop_recovery.py``,
standby readmission in ``standby.py``; how any change is carried out and rolled back is
``reconfigure.py``'s, to which this object lends its store, heartbeats and fault injection
(``reconfigure.Executor``). ``build_resilience`` returns ``None`` when no ``--resihp-*`` feature
is on, so the loop then runs exactly like stock Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.resihp import heartbeat_beacon, recovery, world_abort
from megatron.resihp.detection import (
    LiveDetector, describe, healthy_link_bandwidth_Bps, link_probe_bytes,
)
from megatron.resihp.fail_slow_replan import FailSlowReplan
from megatron.resihp.fail_stop_recovery import EXIT_NEEDS_RESTART, FailStopRecovery, resume_command  # noqa: F401
from megatron.resihp.heartbeat import HeartbeatMonitor, connect_store
from megatron.resihp.injected_faults import InjectedFaults
from megatron.resihp.logging_utils import EventLog, log_line, rank_name, ranks_name, world_numbered
from megatron.resihp.memory_facts import job_memory_facts
from megatron.resihp.parallel_state_patch import installed, message_group
from megatron.resihp.run_state import RunState, StopTraining  # noqa: F401
from megatron.resihp.standby import Readmission, Rejoined
from megatron.resihp.standby_keys import mark_job_done
from resihp_ext.layout import Layout, replica_shape
from resihp_ext.planner.fail_slow import live_hardware
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.detection.traces import observation_to_dict, probe_baselines_to_dict, probe_to_dict
from resihp_ext.detection.validation import Verdict, fail_stop_verdict
from resihp_ext.schedule import Interleaving


class ResilienceHooks:
    """One process's executor: what the training loop calls between iterations.

    Holds the run (``run``, replaced whole by each committed change), the world's heartbeats and
    store, the live detector and this process's injected faults; the three drivers
    (``replan``, ``recovery``, ``readmission``) decide changes, ``reconfigure.apply`` makes them.
    """

    def __init__(self, args: argparse.Namespace, events: EventLog, build_objects: Callable,
                 sharded_optimizer: bool = False, cfg=None, stands_by: bool = True, stages_alike: bool = False,
                 own_splits: bool = False, recovery_keeps_shape: bool = False, shrinks_tp: bool = False,
                 shrinks_every_replica: bool = False, replica_counts: frozenset[int] | None = None,
                 interleaving: Interleaving = Interleaving(), fail_slow_drops: frozenset[int] | None = None):
        """``build_objects(args, layers_per_stage)`` builds a rank's training objects on the installed
        groups; the loop hands its own to each call (``run.objects`` holds none until then). A fail-stop plan keeps every rank at the stage it holds, a fail-slow plan changes
        the micro-batch quotas alone, and a fallback points to the last periodic checkpoint, except
        where the flags below allow more. With ``sharded_optimizer`` (Megatron's distributed
        optimizer) whole replicas go on only when every dead rank's part of the optimizer state
        survives as a copy (``run.part_copies``, made by the loop; without them every fail-stop
        falls back to that checkpoint). ``cfg``: the ``ResiHPConfig`` (``args.resihp`` when None).
        Without ``stands_by`` a rank a plan leaves out exits, whatever ``--resihp-no-standby`` says.
        With ``stages_alike`` a fail-slow plan may also move layers between stages, with one split
        for every replica (what a loop that builds every replica from one model configuration runs).
        With ``own_splits`` each replica may take a layer split of its own instead, keeping its
        ranks and TP groups (a loop that builds each rank's model from its replica's split, its
        gradients then synced layer by layer: ``layer_sync``). With ``recovery_keeps_shape`` a
        fail-stop plan may move state as long as every replica keeps its shape: an intact stage
        group takes a stage that is short, a standby takes a dead rank's place; no replica runs at a
        smaller TP degree, unless ``shrinks_tp``: then a stage group that lost ranks may also run its
        replica at a smaller degree, after every replica at a larger one in DP order (a loop that
        builds each rank's model at its replica's degree). With ``sharded_optimizer`` and
        ``shrinks_every_replica``, a fail-stop plan may instead re-form every replica at one smaller
        TP degree, all alike as the distributed optimizer needs. ``replica_counts``: how many replicas the
        loop can split the global batch over (None: any), which a fail-stop plan keeps to.
        ``interleaving``: the replicas' pipeline schedule, which op timings are read by and plans are
        priced under. ``fail_slow_drops``: the replica counts a fail-slow plan may drop slow
        replicas whole down to, their ranks standing by (None: it drops none)."""
        self.args = args
        self.build_objects = build_objects
        self.saves = None  # the loop's ``AsyncSaves``: what a change does with saves still being written
        self.stages_alike = stages_alike
        self.own_splits = own_splits
        self.recovery_keeps_shape = recovery_keeps_shape
        self.shrinks_tp = recovery_keeps_shape and shrinks_tp
        self.shrinks_every_replica = sharded_optimizer and shrinks_every_replica
        self.replica_counts = replica_counts
        self.fail_slow_drops = fail_slow_drops
        self.interleaving = interleaving
        self.sharded_optimizer = sharded_optimizer
        self.cfg = args.resihp if cfg is None else cfg
        self.memory_facts = job_memory_facts(args, self.cfg.device_memory_gb)
        self.events = events
        rank = dist.get_rank()
        groups = installed()
        # The layout start-up installed; from here on the run lives in ``run``, never on ``args``.
        self.run = RunState(layout=groups.layout, groups=groups, rank=rank, launch_rank=rank,
                            identity=tuple(range(dist.get_world_size())), generation=0, objects=None,
                            quotas=(), messages=message_group(self.cfg.collective_timeout_s),
                            sync=None)
        # A link fault involves its receiver too: it takes part in measuring the healthy link.
        self.injected = InjectedFaults(self.cfg.faults, rank, events, lambda: self.me)
        self.layout_changed_at = -1  # the iteration during which the layout last changed
        # Fail-slow verdicts acted on in this world (its ranks): every later plan starts from them.
        self.known_health = Health()
        # What every replica ran at launch (layers and TP degree per stage): a replica that differs
        # was reshaped by a plan, and a later plan may shape it back.
        self.launch_shape = replica_shape(self.layout.replicas[0])
        self.launch_layout = self.layout
        self.replan = FailSlowReplan(self)
        self.recovery = FailStopRecovery(self)
        self.readmission = Readmission(self)
        self.moved_bytes = 0  # bytes this rank moved in the last change
        self.live = None
        if self.cfg.detection_on:
            self.live = LiveDetector(
                self.cfg, rank, self.run.replica, self.run.stage, self.run.tp_rank, self.device(),
                lambda: self.layout, link_probe_bytes(args), group=self.run.messages, interleaving=interleaving,
            )
            self.live.measure_probe_baselines()
        self.store = self.heartbeat_store = None
        self.monitor = None
        self.planned_out: set[int] = set()
        if self.cfg.detection_on and "MASTER_ADDR" in os.environ:
            timeout_s = max(60.0, 3 * self.cfg.collective_timeout_s)
            self.store = connect_store(timeout_s=timeout_s)
            # The heartbeat gets a connection of its own: a store client serves one request at a
            # time, and forming a world blocks it while peers are missing, which would silence
            # this rank's beats exactly when another rank failed during a re-form.
            self.heartbeat_store = connect_store(timeout_s=timeout_s)
            self._start_monitor()
        # Ranks a fail-slow plan leaves out stand by to rejoin (they need the store to be called).
        self.standby_on = stands_by and self.cfg.enable and not self.cfg.no_standby and self.store is not None
        self.trace = None
        # Written by the decider, which holds every rank's observations.
        if self.cfg.trace and (self.live.deciding if self.live is not None else rank == 0):
            self.trace = open(self.cfg.trace, "w", encoding="utf-8")
            header = {"format": "resihp-trace", "version": 1, "source": "live",
                      "layout": {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                                 "dp": self.run.data_parallel_size},
                      "num_microbatches": args.global_batch_size // args.micro_batch_size,
                      "num_chunks": self.interleaving.num_chunks,
                      "faults": [f.spec() for f in self.cfg.faults]}
            self.trace.write(json.dumps(header) + "\n")
            if self.live is not None and self.live.probe_baselines:
                self.trace.write(json.dumps(probe_baselines_to_dict(self.live.probe_baselines)) + "\n")

    # ------------------------------------------------------------------ the run
    @property
    def layout(self) -> Layout:
        return self.run.layout

    @property
    def rank(self) -> int:
        return self.run.rank

    @property
    def me(self) -> str:
        """This process as log lines name it: its launch rank, and its rank in this world."""
        return rank_name(self.rank, self.run.identity)

    @property
    def replica_index(self) -> int:
        return self.run.replica

    @property
    def generation(self) -> int:
        return self.run.generation

    def _take(self, objects, quotas) -> None:
        """The loop's objects and quotas are the run's (the loop may have split the batch anew)."""
        if objects is not self.run.objects or tuple(quotas or ()) != self.run.quotas:
            self.run = self.run.replace(objects=objects, quotas=tuple(quotas or ()))

    def _give(self):
        return self.run.objects, list(self.run.quotas)

    def commit(self, run: RunState, world_changed: bool) -> None:
        """Make ``run`` (from ``reconfigure.apply``, or new quotas) this process's; in a new world,
        a new detector on its message group (collective: every member commits at the same point)."""
        if run.layout is not self.run.layout:
            self.layout_changed_at = self.iteration
        self.run = run
        if self.live is not None and world_changed:
            costs = self.live.costs  # per layer: they outlive the world, and plan its survivors
            self.live = LiveDetector(self.cfg, run.rank, run.replica, run.stage, run.tp_rank, self.live.device,
                                     lambda: self.layout, self.live.link_probe_bytes, group=run.messages,
                                     interleaving=self.interleaving)
            self.live.costs = costs
            self.live.price_plan()
            self.live.detector.expect(self.known_health.slow_factors, self.known_health.bursts)
            self._trace_follows_decider()
        elif self.live is not None:
            self.live.replica, self.live.stage, self.live.tp_rank = run.replica, run.stage, run.tp_rank

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.args.device == "cuda" else torch.device("cpu")

    def _start_monitor(self, identity: tuple[int, ...] | None = None) -> None:
        """Watch this world's heartbeats; ``identity``: its launch ranks (the run's when None). A
        new world's monitor starts before its run is committed, so the watcher names ranks by the
        world it watches, not by ``self.run``."""
        identity = self.run.identity if identity is None else identity
        rank = dist.get_rank()
        self.monitor = HeartbeatMonitor(
            self.heartbeat_store, rank, dist.get_world_size(),
            interval_s=self.cfg.heartbeat_interval_s, timeout_s=self.cfg.heartbeat_timeout_s,
            prefix=f"resihp/hb/gen{self.generation}/", on_dead=self._on_failed("dead", rank, identity),
            on_hang=self._on_failed("hang", rank, identity), hang_timeout_s=self.cfg.effective_hang_timeout_s,
            failure_grace_s=self.cfg.collective_timeout_s, on_evicted=lambda: self._on_evicted(rank, identity),
            beacon=heartbeat_beacon.current(), identity=identity, hang_iters=self.cfg.hang_iters,
            compile_timeout_s=self.cfg.compile_timeout_s,
        ).start()

    def _on_evicted(self, rank: int, identity: tuple[int, ...]) -> None:  # runs on the heartbeat thread
        # The others re-formed without this rank (judged hung); it still holds its device and
        # sockets, so it fences itself rather than linger.
        log_line(f" resihp: {rank_name(rank, identity)} was left behind by the other ranks "
                 f"(judged hung); exiting")
        os.kill(os.getpid(), signal.SIGKILL)

    def _on_failed(self, kind: str, rank: int, identity: tuple[int, ...]):
        def callback(ranks, now) -> None:  # runs on the heartbeat thread
            # Ranks a recovery already planned without (failed ones, spares that left, a hung rank
            # that fenced itself) go quiet while the new world forms: that is no news.
            ranks = sorted(set(ranks) - self.planned_out)
            if not ranks:
                return
            verdict = fail_stop_verdict(kind, ranks, self.iteration)
            event = verdict.to_event()
            self.events.emit("verdict", self.iteration, **{k: v for k, v in event.items() if k not in ("event", "iteration")})
            log_line(f" resihp: {rank_name(rank, identity)} sees {describe(verdict, identity)}")
            if not self.can_recover:
                return
            # Survivors leave their collectives when a connection to a failed rank breaks, and each
            # then breaks its own (``abandon_world``). A process that died broke its connections
            # itself; a hung one is fenced now, which does; a lost node breaks none, so the world
            # is abandoned from here, even at the cost of interrupting collectives among live ranks.
            # So is every NCCL world: a peer's death does not make NCCL calls fail, only time out.
            if kind == "hang":
                self.monitor.evict(ranks)
            elif (self.backend == "nccl" or set(ranks) & self.monitor.silent_ranks) and dist.is_initialized():
                self.abandon_world()
        return callback

    def abandon_world(self) -> None:
        """Make every collective of this world fail now, on this rank and (through its broken
        connections) on its peers, rather than at the collective timeout."""
        start = time.perf_counter()
        shut = world_abort.abort_world(self.backend)
        log_line(f" resihp: {self.me} abandons world {self.generation}'s collectives "
                 f"({shut} connections shut in {(time.perf_counter() - start) * 1e3:.1f} ms)")

    def inject(self, iteration: int, phase: str) -> None:
        """Injected faults aimed at ``phase`` (of a recovery, a save, the step, the job's end): kills,
        and slowdowns that begin after it."""
        self.injected.in_phase(iteration, phase)

    def stall_in_save(self, iteration: int) -> float:
        """Seconds the writes of this rank's save of ``iteration`` wait (injected stalls)."""
        return self.injected.stall_in_save(iteration)

    def forget_faults_before(self, iteration: int) -> None:
        """After a fail-stop recovery at ``iteration``: faults follow the process (``InjectedFaults``)."""
        self.injected.forget_before(iteration)

    def apply_faults(self, iteration: int, standing_by: bool = False) -> None:
        self.injected.at_start(iteration, self.args, self.device(), standing_by)

    @property
    def faults(self) -> list:
        """This rank's injected faults (a link fault's receiver's too)."""
        return self.injected.faults

    iteration = 0

    def before_iteration(self, iteration: int, objects, quotas):
        self.iteration = iteration
        if self.monitor is not None:
            if self.monitor.store_lost and self.can_recover:
                self.recovery.leave_without_store(iteration, iteration)
            self.monitor.beat(iteration)
        self.apply_faults(iteration)
        return objects, quotas

    @property
    def can_recover(self) -> bool:
        return self.cfg.enable and self.monitor is not None

    def recover(self, iteration: int, error: Exception, objects, consumed_samples: int, quotas=None,
                completed: int | None = None):
        """A collective failed: ``FailStopRecovery.recover``. Returns (objects, quotas) rebuilt on
        the new groups, to redo ``iteration`` (or go on after it: ``completed``, the iterations
        finished when the failure surfaced, is ``iteration`` when it had stepped)."""
        self._take(objects, quotas)
        self.recovery.recover(iteration, error, consumed_samples, completed)
        return self._give()

    def check_standbys(self, iteration: int, objects, quotas, consumed_samples: int):
        """At the start of ``iteration``: ``Readmission.check_standbys``."""
        self._take(objects, quotas)
        self.readmission.check_standbys(iteration, consumed_samples)
        return self._give()

    def stand_by(self) -> Rejoined:
        """On a rank a re-plan left out: ``Readmission.stand_by``."""
        return self.readmission.stand_by()

    @property
    def costs(self):
        """The compute costs the planner uses: pooled by the decider over measured iterations and
        handed to every rank with its commands (kept across re-plans: they are per layer); None
        before the first, or without detection."""
        return None if self.live is None else self.live.costs

    def costs_record(self) -> dict | None:
        """``costs`` as a plan event records them (None: the planner used its reference costs)."""
        return None if self.costs is None else dataclasses.asdict(self.costs)

    def calibrated_hardware(self) -> HardwareModel:
        """The planner's cost model fitted to this job (``resihp_ext.planner.fail_slow.live_hardware``):
        the compute costs the decider fitted to a measured iteration (every rank holds the same),
        and, after a link verdict's probe round, the bandwidth of the links not known to be slow;
        with this job's memory (``memory_facts``), which bounds the layers a stage may take and the
        TP degree a stage may run at."""
        bandwidth = None
        link_rounds = [] if self.live is None else [probes for probes in self.live.probe_rounds if probes.link_s]
        if link_rounds:
            bandwidth = healthy_link_bandwidth_Bps(link_rounds[-1], set(self.known_health.slow_links),
                                                   self.live.link_probe_bytes)
        hw = live_hardware(self.costs, bool(self.args.bf16 or self.args.fp16), bandwidth, self.interleaving)
        return dataclasses.replace(hw, **self.memory_facts)

    # ------------------------------------------------------------------ what the life cycle uses
    @property
    def backend(self) -> str:
        """The default group's backend: gloo on CPU; on CUDA, NCCL for GPU tensors and gloo for the
        host tensors that the loss sum, detection's messages and re-planning exchange (NCCL alone
        rejects a host tensor, and every group made without a backend inherits both)."""
        return "gloo" if self.args.device == "cpu" else "cpu:gloo,cuda:nccl"

    def failure_among(self, members) -> Callable[[], str | None]:
        """A reason to give up on a world of ``members`` (old ranks): the heartbeats name one failed."""
        members = frozenset(members)

        def reason() -> str | None:
            if self.monitor is None:
                return None
            lost = (self.monitor.dead_ranks | self.monitor.hung_ranks) & members
            if not lost:
                return None
            identity = self.monitor.identity  # the heartbeats' world names the ranks
            return f"{ranks_name(lost, identity)} failed before the world of {ranks_name(members, identity)} formed"
        return reason

    def all_done(self, step: str, members: int, finished: bool) -> bool:
        """Whether every one of ``members`` ranks of this world finished ``step`` of a layout change:
        one answer for all of them (``recovery.agree_on_commit``). A failure the heartbeats name,
        or a member missing after three collective timeouts, abandons the step unless every
        member had finished it. True: the new layout stands (a failure then surfaces in the next
        collective, whose recovery starts from it). False: every member goes back.
        """
        if self.store is None:  # no store, no recovery: the first error stands as it is
            return finished

        def failed() -> str | None:
            ranks = self.monitor.dead_ranks | self.monitor.hung_ranks if self.monitor is not None else frozenset()
            return f"{ranks_name(ranks, self.monitor.identity)} failed" if ranks else None

        return recovery.agree_on_commit(self.store, f"resihp/gen{self.generation}/{step}/", members, finished,
                                        stop=failed, wait_s=3 * self.cfg.collective_timeout_s)

    def watch(self, run: RunState) -> None:
        """Watch the heartbeats of ``run``'s world, which just formed, in place of the old one's."""
        if self.monitor is not None:
            self.monitor.stop()
        self.planned_out = set()  # old-world ranks; the new world's monitor starts afresh
        self.run = self.run.replace(generation=run.generation)
        if self.store is not None:
            self._start_monitor(run.identity)

    def unwatch(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def rebuild(self, layout: Layout, rank: int, sync):
        """Model, DDP, optimizer and LR schedule for ``rank``'s replica of the installed ``layout``."""
        replica, _ = layout.stage_of(rank)
        rng = torch.get_rng_state()  # building modules draws from the CPU generator; keep dropout streams
        objects = self.build_objects(self.args, layout.replicas[replica].layers_per_stage)
        torch.set_rng_state(rng)
        if sync is not None:
            objects.config.finalize_model_grads_func = sync
        return objects

    def settle_saves(self, keep: bool) -> None:
        """Checkpoint saves still being written (``async_saves``, where the loop runs them)."""
        if self.saves is not None:
            self.saves.settle(keep)

    def record_moved(self, iteration: int, rank: int, ran, num_bytes: int) -> None:
        """Say which transfers this rank sent (``ran`` by ``reshard``; ranks of the world the moves
        ran in, ``rank`` this rank's there): over every rank, the plan's moves are exactly these."""
        self.moved_bytes = num_bytes
        self.events.emit("moved", iteration, sent=[t.to_dict() for t in ran if t.src == rank and t.crosses])

    def after_iteration(self, iteration: int, elapsed_s: float, result, objects, quotas):
        if self.live is None:
            return objects, quotas
        self.replan.measured(elapsed_s)
        mine = self.live.observation(result.iteration_s, result.ops, result.features, result.busy)
        gathered, settled = self.live.observe(iteration, mine)
        if self.trace is not None and gathered is not None:
            for obs in gathered:
                self.trace.write(json.dumps(observation_to_dict(iteration, obs)) + "\n")
            for probes in self.live.probe_rounds:
                self.trace.write(json.dumps(probe_to_dict(probes)) + "\n")
            if self.live.refined_baselines:
                self.trace.write(json.dumps(probe_baselines_to_dict(self.live.refined_baselines)) + "\n")
        for suspicion, outcome in settled:
            if self.rank == 0:
                self._emit(suspicion.to_event())
                self._emit(outcome.to_event())
                log_line(f" resihp: suspicion at iteration {suspicion.iteration}: "
                         f"{world_numbered(suspicion.reason, self.run.identity)}")
                log_line(f" resihp: {describe(outcome, self.run.identity)}")
        verdicts = [outcome for _, outcome in settled
                    if isinstance(outcome, Verdict) and outcome.kind.fail_slow]
        if verdicts and self.cfg.enable:
            self._take(objects, quotas)
            self.replan.replan(iteration, verdicts)
            return self._give()
        if self.replan.trial is not None:
            self._take(objects, quotas)
            self.replan.check_trial(iteration, elapsed_s)
            return self._give()
        return objects, quotas

    def probe_rounds_run(self) -> int:
        """Probe rounds the last detection step ran (every rank runs the same ones): a suspicion's,
        and a round of a one-stage-group job's own baselines. Probes cost far more than judging,
        and a baseline round happens a few times per job, so measurements of detection's cost per
        iteration tell these steps apart."""
        if self.live is None:
            return 0
        return len(self.live.probe_rounds) + bool(self.live.refined_baselines)

    def _trace_follows_decider(self) -> None:
        """A new world chose its decider: the trace goes on in the process that now judges."""
        if not self.cfg.trace or self.live is None:
            return
        if self.live.deciding and self.trace is None:
            self.trace = open(self.cfg.trace, "a", encoding="utf-8")
        elif not self.live.deciding and self.trace is not None:
            self.trace.close()
            self.trace = None

    def _emit(self, event: dict) -> None:
        event = dict(event)
        self.events.emit(event.pop("event"), event.pop("iteration"), **event)

    def close(self) -> None:
        if self.store is not None and self.rank == 0:
            mark_job_done(self.store, self.launch_layout.world_ranks)
        if self.monitor is not None:
            self.monitor.stop()
        if self.trace is not None:
            self.trace.close()
        if self.live is not None and self.live.deciding:
            self.events.emit("detector_overhead", -1, decision_s=self.live.decision_s,
                             decision_cpu_s=self.live.decision_cpu_s)
