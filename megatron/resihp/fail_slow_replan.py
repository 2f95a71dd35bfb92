"""The fail-slow driver: after fail-slow verdicts, decide which layout change to ask for.

Responsible for turning the verdicts of an iteration into a change: every rank computes the same
decision (``resihp_ext.planner.fail_slow.decide_fail_slow``, pure and deterministic, from the
same gathered observations), so no agreement round is needed; a plan that keeps every rank asks
the life cycle (``reconfigure.apply``) for a SAME-world change, one that leaves ranks out for a
SHRINK change whose leavers stand by (``standby.py``) or exit. Quotas alone change in place.
Megatron's loop, which keeps every replica's ranks, is offered quotas, a layer split of each
replica's own (``own_splits``) or, where the job's features need replicas alike, one split for
every replica (``stages_alike``), slow ranks left out of their TP groups where a replica may run at
a smaller TP degree (``shrinks_tp``), and dropping slow replicas whole (``fail_slow_drops``).
It never builds a group, a model or a world itself.

A re-plan that kept every rank is then on trial (``resihp_ext.planner.adaptation_check``): the
iteration times after it, the same on every rank (the slowest rank's), are judged against those
before it, and a re-plan that did not pay is rolled back through the same life cycle and not
chosen again. One that left ranks out is not rolled back (that would take the leavers back in).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megatron.resihp.logging_utils import log_line, rank_name, world_numbered
from megatron.resihp.reconfigure import LayoutChange, World, apply
from megatron.resihp.run_state import RunState, StopTraining
from resihp_ext.detection.validation import Verdict
from resihp_ext.faults import FaultKind
from resihp_ext.layout import Layout
from resihp_ext.planner.adaptation_check import AdaptationTrial, RejectedPlans
from resihp_ext.planner.fail_slow import decide_fail_slow
from resihp_ext.planner.survivors import megatron_order
from resihp_ext.shard_map import transfers as shard_transfers

# Iterations before a re-plan whose median is the time it is judged against: the verdict comes a few
# iterations after the slowdown starts, so these are slow ones.
BEFORE_ITERS = 3


class FailSlowReplan:
    """Decides the re-plan; ``host`` is the process's ``ResilienceHooks``."""

    def __init__(self, host):
        self.host = host
        self.recent_s: list[float] = []  # this rank's last iteration seconds
        self.trial: AdaptationTrial | None = None
        self.trial_s: list[float] = []  # the agreed iteration seconds since the re-plan on trial
        self.rejected = RejectedPlans()  # changes rolled back in this world

    def measured(self, elapsed_s: float) -> None:
        """This rank's seconds for the iteration just run (before detection's own work)."""
        self.recent_s = [*self.recent_s[-(BEFORE_ITERS - 1):], elapsed_s]

    def _agreed(self, seconds: float) -> float:
        """The slowest rank's ``seconds``: one number every rank of the world holds, so that every
        rank judges a trial alike."""
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host.run.messages)
        return float(value.item())

    def _misjudge(self) -> dict[int, float]:
        """``misjudge:`` faults in force, by rank of this world (every rank plans with them)."""
        run = self.host.run
        where = {launch: rank for rank, launch in enumerate(run.identity)}
        return {where[f.rank]: f.factor for f in self.host.cfg.faults
                if f.kind is FaultKind.MISJUDGE and f.rank in where}

    def _known_factors(self) -> dict[str, float]:
        """The slowdowns a plan is made under, by rank, as every ``plan`` event records them."""
        return {str(r): round(f, 4) for r, f in sorted(self.host.known_health.slow_factors.items())}

    def replan(self, iteration: int, verdicts: list[Verdict]) -> RunState:
        """Apply what ``decide_fail_slow`` decides for ``verdicts`` (compute, link or recovered), in place.

        Returns:
            The run state to go on from (committed on ``host``).
        """
        host = self.host
        start = time.perf_counter()
        run = host.run
        decision = decide_fail_slow(run.layout, host.known_health, verdicts, host.calibrated_hardware(),
                                    list(run.quotas), max(host.args.train_iters - iteration, 1), host.launch_shape,
                                    rejected=self.rejected, misjudge=self._misjudge(),
                                    stages_fixed=not (host.stages_alike or host.own_splits or host.shrinks_tp),
                                    stages_alike=host.stages_alike, ranks_fixed=host.own_splits or host.shrinks_tp,
                                    tp_exclusion=host.shrinks_tp, drop_to=host.fail_slow_drops)
        plan, host.known_health = decision.plan, decision.known
        # Kept across the detector's reset below.
        host.live.detector.expect(decision.expected.slow_factors, decision.expected.bursts)
        if run.rank == 0:
            host.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), slow_rank_factors=self._known_factors(),
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after,
                             compute_costs=host.costs_record(), moves=[t.to_dict() for t in plan.moves])
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {world_numbered(plan.reason, run.identity)}")
        if plan.action != "adapt":
            host.live.detector.watch_again(list(decision.watch_ranks), links=list(decision.watch_links))
            return run
        self.trial = None  # a re-plan on trial is judged no further: this one goes on from it
        if plan.layout != run.layout:
            self.change_layout(plan.layout, plan.transfers, iteration)
        host.commit(host.run.replace(quotas=tuple(plan.quotas)), world_changed=False)
        if host.cfg.verify_iters and host.run.layout.world_ranks == run.layout.world_ranks and self.recent_s:
            self.trial = AdaptationTrial(
                iteration=iteration, before_s=self._agreed(statistics.median(self.recent_s)),
                predicted_before_s=plan.iteration_s_before, predicted_after_s=plan.iteration_s_after,
                old_layout=run.layout, old_quotas=tuple(run.quotas), new_layout=host.run.layout,
                new_quotas=tuple(plan.quotas), window_iters=host.cfg.verify_iters, margin=host.cfg.verify_margin)
            self.trial_s = []
        duration = time.perf_counter() - start
        # The known slow device is the new normal (its slowdown divided out): only a further change alarms.
        host.live.start_over()
        layers = [list(r.layers_per_stage) for r in host.layout.replicas]
        if host.run.rank == 0:
            host.events.emit("adapted", iteration, world_size=dist.get_world_size(), quotas=list(plan.quotas),
                             layers_per_replica=layers, duration_s=duration)
            log_line(f" resihp: adapted in place at iteration {iteration}: layers per replica {layers}, "
                     f"micro-batch quotas {list(plan.quotas)} ({duration * 1000:.0f} ms)")
        return host.run

    def check_trial(self, iteration: int, elapsed_s: float) -> RunState:
        """With a re-plan on trial: measure ``iteration`` (``elapsed_s`` on this rank) and, once the
        trial's window is full, keep the re-plan or roll it back.

        Returns:
            The run state to go on from (committed on ``host``).
        """
        host, trial = self.host, self.trial
        if trial is None:
            return host.run
        self.trial_s.append(self._agreed(elapsed_s))
        verdict = trial.judge(self.trial_s)
        if verdict is None:
            return host.run
        self.trial = None
        if host.run.rank == 0:
            host.events.emit("adaptation_check", iteration, replanned_at=trial.iteration, kept=verdict.keep,
                             before_s=verdict.before_s, measured_after_s=verdict.measured_after_s,
                             predicted_before_s=trial.predicted_before_s, predicted_after_s=trial.predicted_after_s,
                             prediction_error=verdict.prediction_error, reason=verdict.reason)
            log_line(f" resihp: re-plan of iteration {trial.iteration} {verdict.reason}")
        if verdict.keep:
            return host.run
        start = time.perf_counter()
        self.rejected = self.rejected.with_rollback(trial, verdict)
        back = () if trial.old_layout == host.run.layout else shard_transfers(host.run.layout, trial.old_layout)
        if host.run.rank == 0:
            # The change back is a plan like any other: what it moves is what it lists.
            host.events.emit("plan", iteration, action="adapt", policy="rollback", reason=verdict.reason,
                             quotas=list(trial.old_quotas), slow_rank_factors=self._known_factors(),
                             predicted_iteration_s_before=trial.predicted_after_s,
                             predicted_iteration_s_after=trial.predicted_before_s,
                             moves=[t.to_dict() for t in back])
        if back:
            self.change_layout(trial.old_layout, back, iteration)
        host.commit(host.run.replace(quotas=trial.old_quotas), world_changed=False)
        host.live.start_over()
        if host.run.rank == 0:
            layers = [list(r.layers_per_stage) for r in host.layout.replicas]
            host.events.emit("rolled_back", iteration, replanned_at=trial.iteration, quotas=list(trial.old_quotas),
                             layers_per_replica=layers, duration_s=time.perf_counter() - start)
            log_line(f" resihp: rolled back at iteration {iteration} to layers per replica {layers}, micro-batch "
                     f"quotas {list(trial.old_quotas)}; the same change is not made again")
        return host.run

    def change_layout(self, new_layout: Layout, transfers, iteration: int) -> RunState:
        """Ask for ``new_layout`` over these processes (``transfers``: exactly the plan's, in this
        world's ranks): SAME world when it keeps every rank, else SHRINK, its leavers handing over
        their shards and standing by (or exiting without standbys).

        Raises:
            ChangeFailed: a rank failed before every rank had moved its state; every rank is back
                on the old layout, and the fail-stop recovery starts from it.
            StopTraining: this rank leaves (a ``StandingBy`` when it stands by).
        """
        host = self.host
        run = host.run
        if set(new_layout.world_ranks) == set(run.layout.world_ranks):
            change = LayoutChange(kind="replan", world=World.SAME, iteration=iteration, old_layout=run.layout,
                                  new_layout=new_layout, transfers=tuple(transfers))
            host.commit(apply(change, run, host), world_changed=False)
            return host.run
        # Megatron-LM's loop numbers the replicas in the plan's order (largest TP degree first where a
        # slow rank left its group: ``Layout.tp_degrees_descend``); otherwise the kept ranks keep theirs.
        kept = megatron_order(new_layout.replicas) if host.shrinks_tp else sorted(new_layout.world_ranks)
        dense = {old: new for new, old in enumerate(kept)}
        # A world number no earlier one used; the leavers' standbys keep it too.
        run = run.replace(generation=run.generation + 1)
        host.run = run
        # Under the distributed optimizer every rank hands its part of the optimizer state to the kept
        # ranks of its position, which split it anew and gather their weights from it; each keeps its
        # own stage's weights meanwhile (the kept replicas hold every layer).
        parts = run.part_copies is not None
        change = LayoutChange(kind="replan", world=World.SHRINK, iteration=iteration, old_layout=run.layout,
                              new_layout=new_layout, transfers=() if parts else tuple(transfers), new_rank=dense,
                              leave=self._leave, part_sources={} if parts else None, reload_own=parts)
        new = apply(change, run, host)
        if host.standby_on:
            host.readmission.standbys |= {run.identity[r] for r in run.layout.world_ranks if r not in kept}
        host.known_health = host.known_health.relabel(dense)
        host.commit(new, world_changed=True)
        return host.run

    def _leave(self, old_rank: int) -> None:
        """A rank the re-plan leaves out, once its shards are handed over: stands by, or exits."""
        if self.host.standby_on:
            raise self.host.readmission.standing_by(old_rank)
        dist.destroy_process_group()
        raise StopTraining(0, f"{rank_name(old_rank, self.host.run.identity)} is a spare after the re-plan; its "
                              f"shards were handed over")
