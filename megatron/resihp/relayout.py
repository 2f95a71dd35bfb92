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
from resihp_ext.planner.bursts import weigh_bursts
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.shard_map import transfers as plan_transfers
from resihp_ext.detection.validation import Verdict


class StopTraining(Exception):
    """Raised when this process leaves the job (spare, or checkpoint fallback)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def replica_shape(replica) -> tuple:
    """Layers and TP degree of each stage: what two replicas must share to train alike."""
    return replica.layers_per_stage, tuple(s.tp_degree for s in replica.stages)


def replicas_alike(layout: Layout) -> bool:
    return len({replica_shape(r) for r in layout.replicas}) == 1


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
        self.sync = None if replicas_alike(layout) else LayoutGradSync(layout, self.rank, self.cfg.collective_timeout_s)
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
        """The planner's cost model fitted to this job: the compute costs the decider fitted to a
        measured iteration (``resihp_ext.planner.calibration``; every rank holds the same), in the
        parameters' dtype across pipeline boundaries. A link verdict's probe round gives the
        bandwidth of the links not known to be slow (``known_health``; without such a round, the
        default bandwidth stands: every candidate then crosses the same healthy links)."""
        hw = {}
        half = self.args.bf16 or self.args.fp16
        hw["activation_bytes_per_value"] = 2.0 if half else 4.0
        link_rounds = [probes for probes in self.live.probe_rounds if probes.link_s]
        if link_rounds:
            bandwidth = healthy_link_bandwidth_Bps(link_rounds[-1], set(self.known_health.slow_links),
                                                   self.live.link_probe_bytes)
            if bandwidth is not None:
                hw["link_bandwidth_Bps"] = bandwidth
        if self.costs is None:  # no iteration measured yet
            return HardwareModel(regroup_s=0.5, **hw)
        return self.costs.hardware(regroup_s=0.5, **hw)

    @staticmethod
    def _verdict_health(verdict: Verdict) -> Health:
        """The planner's view of a fail-slow verdict: each slow rank's speed, or the slow link's; for a
        ``recovered`` verdict, the rank's speed now (1.0 when healthy again)."""
        if verdict.kind == "link":
            src, dst = verdict.ranks
            return Health(slow_links={(src, dst): 1.0 / max(verdict.factor or 1.0, 1.0)})
        factors = verdict.evidence.get("probe_factors", {})
        return Health(speed={r: 1.0 / max(float(factors.get(str(r), verdict.factor or 1.0)), 1.0)
                             for r in verdict.ranks},
                      bursts=frozenset(verdict.ranks) if verdict.evidence.get("intermittent") else frozenset())

    def _replan(self, iteration: int, verdicts: list[Verdict], objects, quotas):
        """Fail-slow (compute, link or recovered verdicts): plan with the calibrated cost model, apply
        it in place.

        The plan sees every slowdown found so far in this world (``known_health``), not only these
        verdicts', so quotas moved away from an earlier slow rank stay away when another one slows.
        Every rank computes the same plan from the same gathered observations and verdicts (pure,
        deterministic), so no agreement round is needed.
        """
        start = time.perf_counter()
        calm = self.known_health  # between the bursts of a rank slow in bursts
        for verdict in verdicts:
            health = self._verdict_health(verdict)
            self.known_health = self.known_health.updated(health)
            if not verdict.evidence.get("intermittent"):
                calm = calm.updated(health)
        horizon = max(self.args.train_iters - iteration, 1)
        hw = self._calibrated_hardware()
        plan = plan_adaptation(self.layout, self.known_health, hw,
                               current_quotas=tuple(quotas), horizon_iters=horizon, uniform_tp_per_replica=True,
                               reshaped=[r for r, rep in enumerate(self.layout.replicas)
                                         if replica_shape(rep) != self.launch_shape])
        # What the detector takes as the norm from now on: every verdict so far, bursts included.
        expected = self.known_health
        shares = [v.evidence.get("slow_share") for v in verdicts if v.evidence.get("intermittent")]
        if shares:
            # Unknown shares count as always slow; of several, the largest.
            share = max(1.0 if s is None else float(s) for s in shares)
            plan = weigh_bursts(plan, self.layout, quotas, calm, self.known_health, share, hw, horizon)
            if plan.action != "adapt":
                self.known_health = calm  # bursts not worth planning around: later plans do not see them
        self.live.detector.expect(expected.slow_factors, expected.bursts)  # kept across the reset below
        if self.rank == 0:
            slow_factors = {str(r): round(f, 4) for r, f in sorted(self.known_health.slow_factors.items())}
            self.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), slow_rank_factors=slow_factors,
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after,
                             compute_costs=self.costs_record())
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason}")
        if plan.action != "adapt":
            # The layout stays and these slowdowns are expected now: their groups are judged again,
            # so that a rank that slows further (or recovers) is seen, and a slow link against its
            # slow speed, so that it is seen if it slows further.
            self.live.detector.watch_again([r for v in verdicts if v.kind != "link" for r in v.ranks],
                                           links=[tuple(v.ranks) for v in verdicts if v.kind == "link"])
            return objects, quotas
        if plan.layout != self.layout:
            objects, _ = self._apply_layout(plan.layout, objects, iteration)
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
    def _apply_layout(self, new_layout: Layout, objects, iteration: int = 0):
        """New layout over the same processes; returns (new objects, bytes this rank moved).

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
            return self._apply_shrinking_layout(new_layout, objects)
        args = self.args
        old_layout, old_groups, old_sync = self.layout, args.groups, self.sync
        old_replica, old_dp = self.replica_index, args.data_parallel_size
        failure = None
        try:
            groups = build_groups(new_layout, self.rank, timeout=self.cfg.collective_timeout_s)
            install(groups)
            self._adopt(new_layout, groups, world_changed=False)
            new_objects = self._rebuild(new_layout)
            self._apply_recovery_faults(iteration, "replan")
            moved = apply_transfers(plan_transfers(old_layout, new_layout), old_layout, new_layout, self.rank,
                                    objects, new_objects)
            carry_schedule(objects, new_objects)
        except RuntimeError as error:
            failure = error
        # A rank that failed never counts as finished, so it always goes back with the others.
        if not self._all_done(f"replan{iteration}", old_layout.world_size, finished=failure is None):
            new_sync = self.sync
            self.layout, args.groups, self.sync = old_layout, old_groups, old_sync
            self.replica_index = args.replica_index = old_replica
            args.data_parallel_size = old_dp
            install(old_groups)
            if new_sync is not None and new_sync is not old_sync:
                new_sync.destroy()
            why = str(failure).splitlines()[0][:120] if failure is not None else "another rank failed"
            log_line(f" resihp: rank {self.rank}: the re-plan at iteration {iteration} failed before every "
                     f"rank had moved its state ({why}); back on the old layout")
            raise failure or RuntimeError(f"a rank failed before every rank had moved its state for the re-plan "
                                          f"at iteration {iteration}")
        teardown(old_groups)
        if old_sync is not None:
            old_sync.destroy()
        return new_objects, moved

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

    def _apply_shrinking_layout(self, new_layout: Layout, objects):
        """Spares leave: move state while they are still members, then re-form without them.

        Raises:
            StopTraining: on a spare, after it has sent what the kept ranks need from it.
        """
        old_layout, old_rank = self.layout, self.rank
        moves = plan_transfers(old_layout, new_layout)
        received = stage_transfers(moves, old_layout, old_rank, objects, peer_rank=lambda r: r)
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
