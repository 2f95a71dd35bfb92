"""What a policy does about one health state, in a form every policy can express.

Responsible for ``Response``: the plan a policy runs first and, for policies that escalate
(Greyhound's ski-rental), the plan it switches to and when. Scores over a horizon and over a
segment of a timeline are computed here from the plans' predicted seconds, so every policy is
charged by the same arithmetic. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
