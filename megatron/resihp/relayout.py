"""Executing layout changes in place: fail-slow re-plans and the re-forms that follow a fail-stop.

Responsible for the "act" half of an adaptation once a plan exists: calibrating the planner's
cost model for fail-slow plans, building and installing the new groups, rebuilding model, DDP and
optimizer, moving state (``reshard``), choosing the gradient sync (megatron-core's DDP when
replicas are alike, ``LayoutGradSync`` when they differ), and adopting the new world's rank,
replica and detector. ``LayoutChanges`` is mixed into ``ResilienceHooks`` and works on its state;
it never decides a plan itself.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron.resihp import recovery
from megatron.resihp.detection import LiveDetector, healthy_link_bandwidth_Bps
from megatron.resihp.initialize import world_backend
from megatron.resihp.layer_sync import LayoutGradSync
from megatron.resihp.logging_utils import log_line
from megatron.resihp.model_builder import TrainingObjects, build_training_objects
from megatron.resihp.parallel_state_patch import build_groups, install, teardown
from megatron.resihp.reshard import apply_transfers, carry_schedule, stage_transfers, unstage_transfers
from resihp_ext.layout import Layout
from resihp_ext.planner.fail_slow import decide_fail_slow, live_hardware
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.detection.validation import Verdict


class StopTraining(Exception):
    """Raised when this process leaves the job (spare, or checkpoint fallback)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


class LayoutChanges:
    """Mixin: expects ``args``, ``cfg``, ``events``, ``rank``, ``layout``, ``sync``, ``live``,
    ``store``, ``monitor``, ``generation``, ``replica_index``, ``known_health``,
    ``costs``, ``costs_record``, ``identity``, ``standby_on``, ``standbys``, ``renumber``,
    ``_standing_by``, ``_start_monitor`` and ``_apply_recovery_faults`` on the object it is
    mixed into."""

    # ------------------------------------------------------------------ shared steps
    def _rebuild(self, layout: Layout) -> TrainingObjects:
        """Model, DDP, optimizer and LR schedule for this rank's replica of ``layout``."""
        replica, _ = layout.stage_of(self.rank)
        rng = torch.get_rng_state()  # building modules draws from the CPU generator; keep dropout streams
        objects = build_training_objects(self.args, layout.replicas[replica].layers_per_stage)
        torch.set_rng_state(rng)
        if self.sync is not None:
            objects.config.finalize_model_grads_func = self.sync
        return objects

    def _adopt(self, layout: Layout, groups, world_changed: bool, start_monitor: bool = True) -> None:
        """Make ``layout`` (in current-world ranks) this process's: rank, replica, sync, detector, and
        in a new world its heartbeat monitor (unless the caller started it when the world formed)."""
        args = self.args
        args.groups = groups
        self.rank = args.rank = dist.get_rank()
        self.layout = layout
        replica, stage = layout.stage_of(self.rank)
        self.replica_index = args.replica_index = replica
        args.data_parallel_size = layout.num_replicas
        args.world_size = dist.get_world_size()
        self.sync = None if layout.replicas_alike() else LayoutGradSync(layout, self.rank, groups.sync_groups)
        if self.live is not None and world_changed:
            costs = self.live.costs  # per layer: they outlive the world, and plan its survivors
            self.live = LiveDetector(self.cfg, self.rank, replica, stage, layout.tp_rank_of(self.rank),
                                     self.live.device, lambda: self.layout, self.live.link_probe_bytes)
            self.live.costs = costs
            self.live.detector.expect(self.known_health.slow_factors, self.known_health.bursts)
            self._trace_follows_decider()
        elif self.live is not None:
            self.live.replica, self.live.stage, self.live.tp_rank = replica, stage, layout.tp_rank_of(self.rank)
        if world_changed and start_monitor and self.store is not None:
            self._start_monitor()

    # ------------------------------------------------------------------ fail-slow
    def _calibrated_hardware(self) -> HardwareModel:
        """The planner's cost model fitted to this job (``resihp_ext.planner.fail_slow.live_hardware``):
        the compute costs the decider fitted to a measured iteration (every rank holds the same),
        and, after a link verdict's probe round, the bandwidth of the links not known to be slow."""
        bandwidth = None
        link_rounds = [probes for probes in self.live.probe_rounds if probes.link_s]
        if link_rounds:
            bandwidth = healthy_link_bandwidth_Bps(link_rounds[-1], set(self.known_health.slow_links),
                                                   self.live.link_probe_bytes)
        return live_hardware(self.costs, bool(self.args.bf16 or self.args.fp16), bandwidth)

    def _replan(self, iteration: int, verdicts: list[Verdict], objects, quotas):
        """Fail-slow (compute, link or recovered verdicts): apply what
        ``resihp_ext.planner.fail_slow.decide_fail_slow`` decides, in place.

        Every rank computes the same decision from the same gathered observations and verdicts
        (pure, deterministic), so no agreement round is needed.
        """
        start = time.perf_counter()
        decision = decide_fail_slow(self.layout, self.known_health, verdicts, self._calibrated_hardware(), quotas,
                                    max(self.args.train_iters - iteration, 1), self.launch_shape)
        plan, self.known_health = decision.plan, decision.known
        # Kept across the detector's reset below.
        self.live.detector.expect(decision.expected.slow_factors, decision.expected.bursts)
        if self.rank == 0:
            slow_factors = {str(r): round(f, 4) for r, f in sorted(self.known_health.slow_factors.items())}
            self.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), slow_rank_factors=slow_factors,
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after,
                             compute_costs=self.costs_record(), moves=[t.to_dict() for t in plan.moves])
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason}")
        if plan.action != "adapt":
            self.live.detector.watch_again(list(decision.watch_ranks), links=list(decision.watch_links))
            return objects, quotas
        if plan.layout != self.layout:
            objects, _ = self._apply_layout(plan.layout, plan.transfers, objects, iteration)
        quotas = list(plan.quotas)
        duration = time.perf_counter() - start
        # Refit: the known slow device is the new normal; only a further change should alarm.
        self.live.detector.reset(forget_predictor=True)
        self.live.drop_planned_probes()
        if self.rank == 0:
            self.events.emit("adapted", iteration, world_size=dist.get_world_size(), quotas=quotas,
                             layers_per_replica=[list(r.layers_per_stage) for r in self.layout.replicas],
                             duration_s=duration)
            log_line(f" resihp: adapted in place at iteration {iteration}: layers per replica "
                     f"{[list(r.layers_per_stage) for r in self.layout.replicas]}, micro-batch quotas {quotas} "
                     f"({duration * 1000:.0f} ms)")
        return objects, quotas

    # ------------------------------------------------------------------ executing a new layout
    def _apply_layout(self, new_layout: Layout, transfers, objects, iteration: int = 0):
        """New layout over the same processes; returns (new objects, bytes this rank moved).

        ``transfers``: exactly what the plan priced (``Plan.transfers``: ``resihp_ext.shard_map``'s
        transfers from the running layout to ``new_layout``); every one is run, and no other.

        Same world: new groups, rebuilt objects, state moved point-to-point, old groups torn down.
        A layout that leaves ranks out (they become spares) goes through ``_apply_shrinking_layout``.

        Moves only read the old objects, so until every rank has finished its moves the old layout
        and objects are still whole. If a rank fails before that, every survivor goes back to the
        old layout and raises, and the fail-stop recovery starts from a state all of them share.
        If it fails after every rank has, the new layout and objects are returned as usual: the
        failure surfaces in the next collective, and the recovery starts from them.

        Raises:
            RuntimeError: a rank failed before all moves were done (this rank is back on the old layout).
        """
        if set(new_layout.world_ranks) != set(self.layout.world_ranks):
            return self._apply_shrinking_layout(new_layout, transfers, objects, iteration)
        args = self.args
        old_layout, old_groups, old_sync = self.layout, args.groups, self.sync
        old_replica, old_dp = self.replica_index, args.data_parallel_size
        failure = groups = None
        ran: list = []
        try:
            groups = build_groups(new_layout, self.rank, timeout=self.cfg.collective_timeout_s)
            install(groups)
            self._adopt(new_layout, groups, world_changed=False)
            new_objects = self._rebuild(new_layout)
            self._apply_recovery_faults(iteration, "replan")
            moved = apply_transfers(transfers, old_layout, new_layout, self.rank, objects, new_objects, ran=ran)
            carry_schedule(objects, new_objects)
        except RuntimeError as error:
            failure = error
        # A rank that failed never counts as finished, so it always goes back with the others.
        if not self._all_done(f"replan{iteration}", old_layout.world_size, finished=failure is None):
            self.layout, args.groups, self.sync = old_layout, old_groups, old_sync
            self.replica_index = args.replica_index = old_replica
            args.data_parallel_size = old_dp
            install(old_groups)
            if groups is not None:
                teardown(groups)
            why = str(failure).splitlines()[0][:120] if failure is not None else "another rank failed"
            log_line(f" resihp: rank {self.rank}: the re-plan at iteration {iteration} failed before every "
                     f"rank had moved its state ({why}); back on the old layout")
            raise failure or RuntimeError(f"a rank failed before every rank had moved its state for the re-plan "
                                          f"at iteration {iteration}")
        teardown(old_groups)
        self._record_moved(iteration, self.rank, ran)
        return new_objects, moved

    def _record_moved(self, iteration: int, old_rank: int, ran) -> None:
        """Say which transfers this rank sent (``ran`` by ``reshard``; ranks of the world the moves
        ran in, ``old_rank`` this rank's there): over every rank, the plan's moves are exactly these."""
        self.events.emit("moved", iteration, sent=[t.to_dict() for t in ran if t.src == old_rank and t.crosses])

    def _all_done(self, step: str, members: int, finished: bool) -> bool:
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
            return f"ranks {sorted(ranks)} failed" if ranks else None

        return recovery.agree_on_commit(self.store, f"resihp/gen{self.generation}/{step}/", members, finished,
                                        stop=failed, wait_s=3 * self.cfg.collective_timeout_s)

    def _apply_shrinking_layout(self, new_layout: Layout, moves, objects, iteration: int):
        """Spares leave: run ``moves`` (the plan's transfers) while they are still members, then
        re-form without them.

        Raises:
            StopTraining: on a spare, after it has sent what the kept ranks need from it.
        """
        old_layout, old_rank = self.layout, self.rank
        ran: list = []
        received = stage_transfers(moves, old_layout, old_rank, objects, peer_rank=lambda r: r, ran=ran)
        self._record_moved(iteration, old_rank, ran)
        moved = sum(flat.numel() * flat.element_size() for flat in received.values())
        kept = sorted(new_layout.world_ranks)
        self.generation += 1
        if self.monitor is not None:
            self.monitor.stop()
        if old_rank not in kept:
            if self.standby_on:
                raise self._standing_by(old_rank)
            dist.destroy_process_group()
            raise StopTraining(0, f"rank {old_rank} is a spare after the re-plan; its shards were handed over")
        if self.standby_on:
            self.standbys |= {self.identity[r] for r in old_layout.world_ranks if r not in kept}
        dense = {old: new for new, old in enumerate(kept)}
        relabeled = new_layout.relabel(dense)
        self.known_health = self.known_health.relabel(dense)
        self.renumber(dense)
        groups = recovery.reform_for_plan(self.store, self.generation, dense[old_rank], len(kept), self.backend,
                                          self.cfg.collective_timeout_s, relabeled)
        self._adopt(relabeled, groups, world_changed=True)
        new_objects = self._rebuild(relabeled)
        unstage_transfers(moves, old_layout, new_layout, old_rank, objects, new_objects, received)
        carry_schedule(objects, new_objects)
        return new_objects, moved

    @property
    def backend(self) -> str:
        return world_backend(self.args.device)
