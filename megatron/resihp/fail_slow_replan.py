"""The fail-slow driver: after fail-slow verdicts, decide which layout change to ask for.

Responsible for turning the verdicts of an iteration into a change: every rank computes the same
decision (``resihp_ext.planner.fail_slow.decide_fail_slow``, pure and deterministic, from the
same gathered observations), so no agreement round is needed; a plan that keeps every rank asks
the life cycle (``reconfigure.apply``) for a SAME-world change, one that leaves ranks out for a
SHRINK change whose leavers stand by (``standby.py``) or exit. Quotas alone change in place. It
never builds a group, a model or a world itself.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron.resihp.logging_utils import log_line
from megatron.resihp.reconfigure import LayoutChange, World, apply
from megatron.resihp.run_state import RunState, StopTraining
from resihp_ext.layout import Layout
from resihp_ext.planner.fail_slow import decide_fail_slow
from resihp_ext.detection.validation import Verdict


class FailSlowReplan:
    """Decides the re-plan; ``host`` is the process's ``ResilienceHooks``."""

    def __init__(self, host):
        self.host = host

    def replan(self, iteration: int, verdicts: list[Verdict]) -> RunState:
        """Apply what ``decide_fail_slow`` decides for ``verdicts`` (compute, link or recovered), in place.

        Returns:
            The run state to go on from (committed on ``host``).
        """
        host = self.host
        start = time.perf_counter()
        run = host.run
        decision = decide_fail_slow(run.layout, host.known_health, verdicts, host.calibrated_hardware(),
                                    list(run.quotas), max(host.args.train_iters - iteration, 1), host.launch_shape)
        plan, host.known_health = decision.plan, decision.known
        # Kept across the detector's reset below.
        host.live.detector.expect(decision.expected.slow_factors, decision.expected.bursts)
        if run.rank == 0:
            slow_factors = {str(r): round(f, 4) for r, f in sorted(host.known_health.slow_factors.items())}
            host.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), slow_rank_factors=slow_factors,
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after,
                             compute_costs=host.costs_record(), moves=[t.to_dict() for t in plan.moves])
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason}")
        if plan.action != "adapt":
            host.live.detector.watch_again(list(decision.watch_ranks), links=list(decision.watch_links))
            return run
        if plan.layout != run.layout:
            self.change_layout(plan.layout, plan.transfers, iteration)
        host.commit(host.run.replace(quotas=tuple(plan.quotas)), world_changed=False)
        duration = time.perf_counter() - start
        # Refit: the known slow device is the new normal; only a further change should alarm.
        host.live.detector.reset(forget_predictor=True)
        host.live.drop_planned_probes()
        layers = [list(r.layers_per_stage) for r in host.layout.replicas]
        if host.run.rank == 0:
            host.events.emit("adapted", iteration, world_size=dist.get_world_size(), quotas=list(plan.quotas),
                             layers_per_replica=layers, duration_s=duration)
            log_line(f" resihp: adapted in place at iteration {iteration}: layers per replica {layers}, "
                     f"micro-batch quotas {list(plan.quotas)} ({duration * 1000:.0f} ms)")
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
        kept = sorted(new_layout.world_ranks)
        dense = {old: new for new, old in enumerate(kept)}
        # A world number no earlier one used; the leavers' standbys keep it too.
        run = run.replace(generation=run.generation + 1)
        host.run = run
        change = LayoutChange(kind="replan", world=World.SHRINK, iteration=iteration, old_layout=run.layout,
                              new_layout=new_layout, transfers=tuple(transfers), new_rank=dense,
                              leave=self._leave)
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
        raise StopTraining(0, f"rank {old_rank} is a spare after the re-plan; its shards were handed over")
