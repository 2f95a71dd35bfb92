"""The training loop's resilience hooks: fault injection, detection, adaptation.

Responsible for executing what ``resihp_ext`` decides, at iteration boundaries: applying
injected faults to this process (stretching compute, SIGKILL, hanging), feeding op timings to the
detector, logging its suspicions and verdicts, and applying plans that need no regrouping
(micro-batch quotas across DP replicas) in place. ``build_resilience`` returns ``None`` when no
``--resihp-*`` feature is on, so the loop then runs exactly like stock Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.resihp import checkpointing, heartbeat_beacon, recovery, world_abort
from megatron.resihp.data_samplers import even_quotas
from megatron.resihp.detection import LiveDetector, describe, link_probe_bytes, link_seconds_per_byte
from megatron.resihp.heartbeat import HeartbeatMonitor, connect_store
from megatron.resihp.link_faults import LINKS
from megatron.resihp.logging_utils import EventLog, log_line
from megatron.resihp.relayout import LayoutChanges, StopTraining
from megatron.resihp.reshard import carry_schedule, unstage_transfers
from megatron.resihp.schedules import RECORDER
from megatron.resihp.standby import Readmissions, mark_job_done
from resihp_ext.faults import FaultKind
from resihp_ext.layout import Layout, replica_shape
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.survivors import continuing_layout, surviving_layout
from resihp_ext.detection.traces import observation_to_dict, probe_baselines_to_dict, probe_to_dict
from resihp_ext.detection.validation import Verdict, fail_stop_verdict

# Exit code of a survivor that saved a checkpoint because no in-place plan existed.
EXIT_NEEDS_RESTART = 3
# Worlds a recovery tries to form before giving up: each failed attempt means another rank left
# while the survivors were re-forming, and each retry plans without it.
_REFORM_ATTEMPTS = 3


def resume_command(argv: list[str], nproc: int, checkpoint_root: str) -> str:
    """The launch that resumes this job from ``checkpoint_root``: same flags, minus any earlier
    ``--load`` and any injected faults (those were tests of this run, not part of the job)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--load", "--resihp-inject"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    return " ".join(["python", "scripts/launch_local.py", f"--nproc-per-node {nproc}", *kept, "--load", checkpoint_root])


class ResilienceHooks(LayoutChanges, Readmissions):
    def __init__(self, args: argparse.Namespace, events: EventLog):
        self.args = args
        self.cfg = args.resihp
        self.events = events
        self.rank = dist.get_rank()
        self.replica_index = parallel_state.get_data_parallel_rank()
        # A link fault involves its receiver too: it takes part in measuring the healthy link.
        self.faults = [f for f in self.cfg.faults if self.rank in (f.rank, f.dst)]
        self._slowing: set = set()  # slow faults in force now
        args.replica_index = self.replica_index
        self.sync = None  # LayoutGradSync while replicas differ
        self._layout_changed_at = -1  # the iteration during which the layout last changed
        # Fail-slow verdicts acted on in this world (its ranks): every later plan starts from them.
        self.known_health = Health()
        # What every replica ran at launch (layers and TP degree per stage): a replica that differs
        # was reshaped by a plan, and a later plan may shape it back.
        self.launch_shape = replica_shape(self.layout.replicas[0])
        # Processes keep their launch rank across re-formed worlds; standbys are named by it.
        self.launch_rank = self.rank
        self.launch_layout = self.layout
        self.identity = list(range(dist.get_world_size()))  # this world's rank -> launch rank
        self.standbys: set[int] = set()
        self._init_readmissions()
        self.live = None
        if self.cfg.detection_on:
            self.live = LiveDetector(
                self.cfg, self.rank, self.replica_index, parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank(), self._device(), lambda: self.layout,
                link_probe_bytes(args),
            )
            self.live.measure_probe_baselines()
        self.generation = 0
        self.store = self.heartbeat_store = None
        self.monitor = None
        self._planned_out: set[int] = set()
        if self.cfg.detection_on and "MASTER_ADDR" in os.environ:
            timeout_s = max(60.0, 3 * self.cfg.collective_timeout_s)
            self.store = connect_store(timeout_s=timeout_s)
            # The heartbeat gets a connection of its own: a store client serves one request at a
            # time, and forming a world blocks it while peers are missing, which would silence
            # this rank's beats exactly when another rank failed during a re-form.
            self.heartbeat_store = connect_store(timeout_s=timeout_s)
            self._start_monitor()
        # Ranks a fail-slow plan leaves out stand by to rejoin (they need the store to be called).
        self.standby_on = self.cfg.enable and not self.cfg.no_standby and self.store is not None
        self.trace = None
        # Written by the decider, which holds every rank's observations.
        if self.cfg.trace and (self.live.deciding if self.live is not None else self.rank == 0):
            self.trace = open(self.cfg.trace, "w", encoding="utf-8")
            header = {"format": "resihp-trace", "version": 1, "source": "live",
                      "layout": {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                                 "dp": args.data_parallel_size},
                      "num_microbatches": args.global_batch_size // args.micro_batch_size,
                      "faults": [f.spec() for f in self.cfg.faults]}
            self.trace.write(json.dumps(header) + "\n")
            if self.live is not None and self.live.probe_baselines:
                self.trace.write(json.dumps(probe_baselines_to_dict(self.live.probe_baselines)) + "\n")

    @property
    def layout(self) -> Layout:
        return self.args.layout

    @layout.setter
    def layout(self, value: Layout) -> None:
        if value is not getattr(self.args, "layout", None):
            self._layout_changed_at = getattr(self, "iteration", 0)
        self.args.layout = value

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.args.device == "cuda" else torch.device("cpu")

    def _start_monitor(self) -> None:
        self.monitor = HeartbeatMonitor(
            self.heartbeat_store, dist.get_rank(), dist.get_world_size(),
            interval_s=self.cfg.heartbeat_interval_s, timeout_s=self.cfg.heartbeat_timeout_s,
            prefix=f"resihp/hb/gen{self.generation}/", on_dead=self._on_failed("dead"),
            on_hang=self._on_failed("hang"), hang_timeout_s=self.cfg.effective_hang_timeout_s,
            failure_grace_s=self.cfg.collective_timeout_s, on_evicted=self._on_evicted,
            beacon=heartbeat_beacon.current(),
        ).start()

    def _on_evicted(self) -> None:  # runs on the heartbeat thread
        # The others re-formed without this rank (judged hung); it still holds its device and
        # sockets, so it fences itself rather than linger.
        log_line(f" resihp: rank {self.rank} was left behind by the other ranks (judged hung); exiting")
        os.kill(os.getpid(), signal.SIGKILL)

    def _on_failed(self, kind: str):
        def callback(ranks, now) -> None:  # runs on the heartbeat thread
            # Ranks a recovery already planned without (failed ones, spares that left, a hung rank
            # that fenced itself) go quiet while the new world forms: that is no news.
            ranks = sorted(set(ranks) - self._planned_out)
            if not ranks:
                return
            verdict = fail_stop_verdict(kind, ranks, self.iteration)
            event = verdict.to_event()
            self.events.emit("verdict", self.iteration, **{k: v for k, v in event.items() if k not in ("event", "iteration")})
            log_line(f" resihp: rank {self.rank} sees {describe(verdict)}")
            if not self.can_recover:
                return
            # Survivors leave their collectives when a connection to a failed rank breaks, and each
            # then breaks its own (``_abandon_world``). A process that died broke its connections
            # itself; a hung one is fenced now, which does; a lost node breaks none, so the world
            # is abandoned from here, even at the cost of interrupting collectives among live ranks.
            # So is every NCCL world: a peer's death does not make NCCL calls fail, only time out.
            if kind == "hang":
                self.monitor.evict(ranks)
            elif (self.backend == "nccl" or set(ranks) & self.monitor.silent_ranks) and dist.is_initialized():
                self._abandon_world()
        return callback

    def _abandon_world(self) -> None:
        """Make every collective of this world fail now, on this rank and (through its broken
        connections) on its peers, rather than at the collective timeout."""
        start = time.perf_counter()
        shut = world_abort.abort_world(self.backend)
        log_line(f" resihp: rank {self.rank} abandons world {self.generation}'s collectives "
                 f"({shut} connections shut in {(time.perf_counter() - start) * 1e3:.1f} ms)")

    def _apply_recovery_faults(self, iteration: int, phase: str) -> None:
        """Injected kills aimed at a phase of a recovery (a second failure during an adaptation)."""
        for fault in self.faults:
            if fault.during == phase and fault.active(iteration):
                self.events.emit("inject", iteration, fault=fault.spec())
                log_line(f" rank {self.rank}: injecting {fault.spec()}")
                os.kill(os.getpid(), signal.SIGKILL)

    def _apply_slowdowns(self, iteration: int) -> None:
        """Stretch this rank's compute by its slowest active slowdown, and say when each starts and ends
        (an intermittent one at every burst). Recomputed each iteration, so a redone iteration or a
        re-plan in the middle of a burst keeps the fault where it stands."""
        for fault in (f for f in self.faults if f.kind is FaultKind.SLOW):
            now = fault.active(iteration)
            if now == (fault in self._slowing):
                continue
            if now:
                self._slowing.add(fault)
                self.events.emit("inject", iteration, fault=fault.spec())
                log_line(f" rank {self.rank}: injecting {fault.spec()}")
            else:
                self._slowing.discard(fault)
                self.events.emit("inject_end", iteration, fault=fault.spec())
                ended = fault.until_iteration is not None and iteration >= fault.until_iteration
                log_line(f" rank {self.rank}: {fault.spec()} {'pauses' if fault.intermittent and not ended else 'ends'}")
        RECORDER.slowdown_factor = max((f.factor for f in self._slowing), default=1.0)

    def _apply_faults(self, iteration: int, standing_by: bool = False) -> None:
        self._apply_slowdowns(iteration)
        for fault in self.faults:
            if standing_by and fault.kind in (FaultKind.LINK, FaultKind.HANG):
                continue  # a standby sends nothing and makes no progress that could stop
            if fault.kind is FaultKind.SLOW or fault.at_iteration != iteration or fault.during is not None:
                continue
            if fault.kind is FaultKind.LINK:
                self._slow_link(fault)
                continue
            self.events.emit("inject", iteration, fault=fault.spec())
            log_line(f" rank {self.rank}: injecting {fault.spec()}")
            if fault.kind is FaultKind.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                while True:  # a hung rank: alive, holding its sockets, making no progress
                    time.sleep(3600)

    def _slow_link(self, fault) -> None:
        """Measure the healthy link with its receiver, then slow this rank's sends over it."""
        per_byte = link_seconds_per_byte(fault.src, fault.dst, self._device(), link_probe_bytes(self.args))
        if per_byte is None:  # the receiver
            return
        LINKS.slow(fault.dst, fault.factor, per_byte)
        self.events.emit("inject", self.iteration, fault=fault.spec(), healthy_s_per_mib=per_byte * 2**20)
        log_line(f" rank {self.rank}: injecting {fault.spec()} (healthy link {per_byte * 2**20 * 1e3:.3f} ms/MiB)")

    iteration = 0

    def before_iteration(self, iteration: int, objects, quotas):
        self.iteration = iteration
        if self.monitor is not None:
            self.monitor.beat(iteration)
        self._apply_faults(iteration)
        return objects, quotas

    @property
    def can_recover(self) -> bool:
        return self.cfg.enable and self.monitor is not None

    def recover(self, iteration: int, error: Exception, objects, consumed_samples: int, quotas=None,
                completed: int | None = None):
        """A collective failed: find who died, agree on a plan, continue in place or leave.

        Ranks of this world outside the layout are leaving it (the joiners of a readmission that
        failed before every member had its state): they are planned without, like the dead. With
        no world at all (a readmission whose rendezvous failed), the layout's ranks re-form.
        ``quotas``: the running split of the batch, kept when no rank of the layout failed.

        ``completed``: the iterations finished when the failure surfaced, which a fallback checkpoint
        saves with ``consumed_samples``: ``iteration - 1`` (the default) when ``iteration`` is
        redone, ``iteration`` when it had stepped (a failure during detection or a checkpoint save).

        Returns:
            (objects, quotas) rebuilt on the new groups, to redo ``iteration`` (or go on after it).

        Raises:
            StopTraining: this process is a spare, or no in-place plan exists (after saving).
            The original error, when the heartbeats name no failed rank.
        """
        start = time.perf_counter()
        old_rank = self.rank  # also when a grown world's rendezvous failed and no world is left
        log_line(f" resihp: rank {old_rank}: iteration {iteration} failed: {str(error).splitlines()[0][:160]}")
        self.monitor.mark_recovering()
        if dist.is_initialized():
            # This rank has left its collective; peers still blocked on it must leave theirs too.
            # Shutting its connections ends only collectives this rank belongs to, which cannot
            # finish without it; what it sent before still arrives first.
            self._abandon_world()
        failed = left = frozenset()  # left: spares of an earlier attempt's plan, gone or about to go
        has_world = dist.is_initialized()
        outside = frozenset(range(dist.get_world_size()) if has_world else ()) - frozenset(self.layout.world_ranks)
        for attempt in range(1, _REFORM_ATTEMPTS + 1):
            # A hung peer is only named once its stall passes the hang timeout. With ranks leaving
            # anyway, or no world left, a re-form is due whoever failed, and one that meets a hung
            # rank fails and comes back here to wait for its name.
            leaving = attempt == 1 and (bool(outside) or not has_world)
            wait_s = (2 * self.cfg.heartbeat_timeout_s if leaving
                      else self.cfg.effective_hang_timeout_s + 4 * self.cfg.heartbeat_timeout_s)
            named = recovery.await_failed_ranks(self.monitor, wait_s=wait_s,
                                                settle_s=2 * self.cfg.heartbeat_interval_s) - outside
            if not named - failed and not leaving:
                raise error
            self.generation += 1
            plan, failed, preferred = recovery.agree_on_plan(
                self.store, self.generation, old_rank, self.layout, named | failed | left, self._preferred_plan,
                wait_s=3 * self.cfg.collective_timeout_s,
                hw=self._survivor_hardware(), health=self.known_health,
            )
            self._planned_out = set(self.layout.world_ranks) - set(plan.new_rank) | outside
            leader = old_rank == min(set(self.layout.world_ranks) - failed)
            if leader:
                self.monitor.evict(failed)  # a hung rank among them fences itself
                self.events.emit("plan", iteration, action=plan.action, reason=plan.reason, executed=plan.to_dict(),
                                 preferred=preferred, attempt=attempt, compute_costs=self.costs_record())
            log_line(f" resihp: plan ({plan.action}): {plan.reason}")
            if plan.action != "adapt":
                self.monitor.stop()
                self._fallback_checkpoint(old_rank, iteration, plan, objects, consumed_samples, failed, self.backend,
                                          iteration - 1 if completed is None else completed)
            left = frozenset(plan.spares)
            moves = plan.transfers  # what the plan priced, in old ranks: exactly what runs
            if old_rank not in plan.new_rank and (not moves or old_rank in failed):
                self._leave_as_spare(old_rank)
            self._apply_recovery_faults(iteration, "reform")
            new_layout = surviving_layout(self.layout, plan)
            try:
                if moves:
                    # Spares stay for this step: they may hold what a moved stage group needs.
                    survivors = sorted(set(self.layout.world_ranks) - failed)
                    ran: list = []
                    received = recovery.stage_moves(
                        self.store, self.generation, old_rank, survivors, moves, self.layout, objects, self.backend,
                        self.cfg.collective_timeout_s, stop=self._failure_among(survivors),
                        joined=lambda: self._apply_recovery_faults(iteration, "moves"), ran=ran)
                    self._record_moved(iteration, old_rank, ran)
                    if old_rank not in plan.new_rank:
                        self._leave_as_spare(old_rank)
                groups = recovery.reform_for_plan(self.store, self.generation, plan.new_rank[old_rank],
                                                  plan.new_world_size, self.backend, self.cfg.collective_timeout_s,
                                                  new_layout, stop=self._failure_among(plan.new_rank),
                                                  met=lambda: self._apply_recovery_faults(iteration, "rendezvous"))
                break
            except StopTraining:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to form the new world: find out who left
                # The old world's heartbeats are still watched, so a rank that died while the new
                # world formed is named like the first; the next attempt plans without it.
                if attempt == _REFORM_ATTEMPTS:
                    raise
                log_line(f" resihp: rank {old_rank}: re-forming world {self.generation} failed "
                         f"({str(exc).splitlines()[0][:120]}); planning again with the ranks the heartbeats name")
        self.monitor.stop()
        self._planned_out = set()  # old-world ranks; the new world's monitor starts afresh
        self.sync = None  # its groups belonged to the old world
        old_layout = self.layout
        self.known_health = self.known_health.relabel(plan.new_rank)
        self.renumber(plan.new_rank)
        self._adopt(new_layout, groups, world_changed=True)
        new_objects = self._rebuild(new_layout)
        if any(t.dst == old_rank and t.src != old_rank for t in moves):
            # This stage group took another stage: its state arrived in the staged buffers.
            unstage_transfers(moves, old_layout, continuing_layout(old_layout, plan), old_rank, objects,
                              new_objects, received)
        else:
            # A rank at the stage it held before: its own state, same shapes, is all it needs.
            new_objects.model.load_state_dict(objects.model.state_dict())
            new_objects.optimizer.load_state_dict(objects.optimizer.state_dict())
        carry_schedule(objects, new_objects)
        objects, args = new_objects, self.args
        if failed or quotas is None or len(quotas) != args.data_parallel_size:
            quotas = plan.quotas or even_quotas(args.global_batch_size // args.micro_batch_size,
                                                args.data_parallel_size)
        # Faults follow the process; a slowdown under way keeps its end.
        self.faults = [f for f in self.faults if f.at_iteration > iteration or (f.until_iteration or 0) > iteration
                       or (f.kind is FaultKind.SLOW and f.until_iteration is None)]
        LINKS.clear()  # slowed links name old ranks
        duration = time.perf_counter() - start
        if self.rank == 0:
            self.events.emit("adapted", iteration, world_size=dist.get_world_size(), duration_s=duration,
                             data_parallel_size=args.data_parallel_size, quotas=quotas, failed_ranks=sorted(failed))
        log_line(f" resihp: rank {old_rank} -> {self.rank}: adapted in place, world {dist.get_world_size()}, "
                 f"DP {args.data_parallel_size}, {'redoing' if completed is None else 'going on after'} iteration "
                 f"{iteration} ({duration:.2f} s since the failure surfaced)")
        return objects, quotas

    @property
    def costs(self):
        """The compute costs the planner uses: pooled by the decider over measured iterations and
        handed to every rank with its commands (kept across re-plans: they are per layer); None
        before the first, or without detection."""
        return None if self.live is None else self.live.costs

    def costs_record(self) -> dict | None:
        """``costs`` as a plan event records them (None: the planner used its reference costs)."""
        return None if self.costs is None else dataclasses.asdict(self.costs)

    def renumber(self, new_rank) -> None:
        """This world's ranks became ``new_rank[old]`` (ranks it lacks left the world)."""
        order = sorted(new_rank, key=new_rank.get)
        self.identity = [self.identity[old] for old in order]

    def _survivor_hardware(self) -> HardwareModel:
        """The survivor planner's model: memory facts (may a stage run on fewer ranks than its old
        TP group?) and, once an iteration has been measured, the cost model fitted to this job, so
        that whether a slower smaller-TP replica is worth adding, and the batch's split, follow
        this job's own compute and sync times rather than a reference cluster's."""
        gib = self.cfg.device_memory_gb
        if gib is None and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        else:
            memory = gib * 2**30 if gib is not None else HardwareModel.device_memory_bytes
        half = self.args.bf16 or self.args.fp16
        # Megatron keeps fp32 weights, grads and Adam moments (16 bytes) or adds a half copy (18).
        facts = dict(device_memory_bytes=memory, state_bytes_per_param=18.0 if half else 16.0,
                     activation_bytes_per_value=2.0 if half else 4.0)
        if self.costs is None:
            return HardwareModel(**facts)
        return dataclasses.replace(self._calibrated_hardware(), **facts)

    def _failure_among(self, members) -> Callable[[], str | None]:
        """A reason to give up on a world of ``members`` (old ranks): the heartbeats name one failed."""
        members = frozenset(members)

        def reason() -> str | None:
            lost = (self.monitor.dead_ranks | self.monitor.hung_ranks) & members
            return f"ranks {sorted(lost)} failed before the world of ranks {sorted(members)} formed" if lost else None
        return reason

    def _leave_as_spare(self, old_rank: int) -> None:
        self.monitor.stop()
        if dist.is_initialized():  # not after a failed re-form
            dist.destroy_process_group()
        raise StopTraining(0, f"rank {old_rank} is a spare after the adaptation (the new layout does not use it)")

    def _preferred_plan(self, failed) -> dict:
        """What the joint planner would do with unrestricted execution (logged for comparison)."""
        plan = plan_adaptation(self.layout, self.known_health.updated(Health(dead=frozenset(failed))))
        return {"action": plan.action, "policy": plan.policy, "reason": plan.reason}

    def _fallback_checkpoint(self, old_rank, iteration, plan, objects, consumed_samples, failed, backend, completed):
        """No replica can go on: survivors assemble a checkpoint if every shard survived, then stop.

        If some shard died with every holder, the last periodic checkpoint under ``--save`` (if
        any) is the one to resume from; the iterations after it are trained again.
        """
        survivors = sorted(set(self.layout.world_ranks) - failed)
        root = self.args.save or os.path.abspath("resihp_fallback_checkpoint")
        saved = None
        if not plan.missing_shards and completed > 0:
            position = (self.layout.stage_of(old_rank)[1], self.layout.tp_rank_of(old_rank))
            recovery.reform_for_plan(self.store, self.generation, survivors.index(old_rank), len(survivors),
                                     backend, self.cfg.collective_timeout_s, None, stop=self._failure_among(survivors))
            writer = plan.checkpoint_writers.get(position) == old_rank
            saved = recovery.save_assembled_checkpoint(self.args, root, completed, consumed_samples, objects,
                                                       position, writer)
            reason = plan.reason + f"; saved iteration {completed} to {saved}"
        else:
            last = checkpointing.latest_iteration(self.args.save) if self.args.save else None
            if last is not None:
                saved = os.path.join(root, f"iter_{last:07d}")
                redo = (f"iteration {completed} is" if completed == last + 1
                        else f"iterations {last + 1}-{completed} are") if completed > last else "no iteration is"
                reason = (plan.reason + f"; nothing could be saved now, so resume from the last checkpoint, iteration "
                          f"{last} ({saved}): {redo} trained again")
            else:
                reason = plan.reason + ("; nothing saved, and no earlier checkpoint exists: pass --save DIR "
                                        "--save-interval N so that a failure of every holder of a shard can resume")
        resume = resume_command(sys.argv, len(self.launch_layout.world_ranks), root) if saved else None
        if old_rank == survivors[0]:
            mark_job_done(self.store)
            self.events.emit("fallback_checkpoint", iteration, reason=reason, resume_command=resume, path=saved)
            log_line(f" resihp: no in-place plan: {reason}")
            if resume:
                log_line(f" resihp: resume with: {resume}")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise StopTraining(EXIT_NEEDS_RESTART, reason)

    def after_iteration(self, iteration: int, elapsed_s: float, result, objects, quotas):
        if self.live is None:
            return objects, quotas
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
                log_line(f" resihp: suspicion at iteration {suspicion.iteration}: {suspicion.reason}")
                log_line(f" resihp: {describe(outcome)}")
        verdicts = [outcome for _, outcome in settled
                    if isinstance(outcome, Verdict) and outcome.kind.fail_slow]
        if verdicts and self.cfg.enable:
            objects, quotas = self._replan(iteration, verdicts, objects, quotas)
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
            mark_job_done(self.store)
        if self.monitor is not None:
            self.monitor.stop()
        self.sync = None  # its groups are the installed ones, destroyed with the world
        if self.trace is not None:
            self.trace.close()
        if self.live is not None and self.live.deciding:
            self.events.emit("detector_overhead", -1, decision_s=self.live.decision_s,
                             decision_cpu_s=self.live.decision_cpu_s)


def build_resilience(args: argparse.Namespace, events: EventLog, objects) -> ResilienceHooks | None:
    cfg = args.resihp
    if not (cfg.detection_on or cfg.inject):
        return None
    return ResilienceHooks(args, events)
