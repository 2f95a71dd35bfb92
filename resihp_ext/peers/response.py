"""What a policy does about one health state, in a form every policy can express.

Responsible for ``Response``: the plan a policy runs first and, for policies that escalate
(Greyhound's ski-rental), the plan it switches to and when. Scores over a horizon and over a
segment of a timeline are computed here from the plans' predicted seconds, so every policy is
charged by the same arithmetic. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_ext.layout import Layout
from resihp_ext.planner.cost import equal_quotas, iteration_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan


@dataclass(frozen=True)
class Response:
    """A policy's answer to a health state.

    Attributes:
        policy: the policy's name.
        first: the plan run at once (its ``one_time_cost_s`` is paid before training resumes).
        then: a plan adopted later, or None.
        switch_after_iters: iterations run under ``first`` before ``then`` is adopted (inf: never).
    """

    policy: str
    first: Plan
    then: Plan | None = None
    switch_after_iters: float = math.inf

    @property
    def final(self) -> Plan:
        """The plan that runs in the long term."""
        return self.then if self.then is not None and math.isfinite(self.switch_after_iters) else self.first

    def iterations_in(self, seconds: float) -> float:
        """Iterations completed in ``seconds`` of wall time after the change, costs included.

        Args:
            seconds: wall-clock seconds from the moment the health state began.

        Returns:
            Iterations (fractional) finished in that time; 0 while a one-time cost is being paid.
        """
        t1 = self.first.iteration_s_after
        left = seconds - self.first.one_time_cost_s
        if left <= 0 or not math.isfinite(t1):
            return 0.0
        if self.then is None or not math.isfinite(self.switch_after_iters):
            return left / t1
        before = self.switch_after_iters * t1
        if left <= before:
            return left / t1
        left -= before + self.then.one_time_cost_s
        t2 = self.then.iteration_s_after
        return self.switch_after_iters + (max(left, 0.0) / t2 if math.isfinite(t2) else 0.0)

    def average_iteration_s(self, horizon_iters: int) -> float:
        """Wall seconds per iteration over ``horizon_iters`` iterations, one-time costs included."""
        t1 = self.first.iteration_s_after
        if not math.isfinite(t1):
            return math.inf
        total = self.first.one_time_cost_s
        if self.then is None or self.switch_after_iters >= horizon_iters:
            total += horizon_iters * t1
        else:
            k = self.switch_after_iters
            total += k * t1 + self.then.one_time_cost_s + (horizon_iters - k) * self.then.iteration_s_after
        return total / horizon_iters


def from_plan(plan: Plan, policy: str | None = None) -> Response:
    """A Response that runs ``plan`` and nothing else."""
    return Response(policy or plan.policy, plan)


@dataclass(frozen=True)
class Start:
    """Where a policy's answer starts from: the cost constants, micro-batches per global batch,
    the quotas running now and the iteration seconds if nothing changes."""

    hw: HardwareModel
    num_microbatches: int
    quotas: tuple[int, ...]
    before_s: float


def start(layout: Layout, health: Health, hw: HardwareModel | None, num_microbatches: int | None,
          current_quotas: tuple[int, ...] | None) -> Start:
    """The shared defaults of every policy's signature, resolved once."""
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    quotas = tuple(current_quotas or equal_quotas(layout.num_replicas, num_mb))
    return Start(hw, num_mb, quotas, iteration_s(layout, quotas, health, hw))


def fail_slow_unhandled(policy: str, layout: Layout, at: Start) -> Response:
    """The answer of a policy that acts on fail-stops only: keep running, slowed."""
    return Response(policy, Plan("keep", layout, at.quotas, (), at.before_s, at.before_s, 0.0,
                                 f"{policy}: no fail-stop; fail-slow is not handled", policy=policy))
