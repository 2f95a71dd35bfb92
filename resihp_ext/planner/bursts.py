"""Plans for a device slow in bursts: weigh the bursts against the calm between them.

A rank slow in bursts (``resihp_ext.detection.recurrence``) is planned for at the speed it runs during a
burst. Between bursts it runs at full speed, and the work a plan moved off it then waits on the
others. With replica times linear in their micro-batches, moving work off one of W replicas
gains ``share * f`` per micro-batch in the bursts and costs ``(1 - share) / (W - 1)`` in the calm,
so a plan for the bursts pays only when the bursts fill enough of the time. Rather than that rule
of thumb, this weighs both phases with the planner's own cost model.

Pure: plain values in, a Plan out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from resihp_ext.layout import Layout
from resihp_ext.planner.cost import iteration_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan


def weigh_bursts(plan: Plan, layout: Layout, quotas: Sequence[int], calm: Health, burst: Health, share: float,
                 hw: HardwareModel, horizon_iters: int) -> Plan:
    """``plan`` (made for ``burst``) if it pays over bursts ``share`` of the time and calm the rest,
    else a "keep" Plan that says why.

    Args:
        plan: the plan made for the health during a burst.
        layout: the layout running now.
        quotas: the micro-batch quotas running now.
        calm: the health between bursts (the bursting rank at its known speed).
        burst: the health during a burst.
        share: the share of iterations in a burst, in [0, 1].
        hw: the cost model the plan was made with.
        horizon_iters: iterations over which the plan's one-time cost must pay off.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a share of iterations in bursts must lie in [0, 1], got {share}")
    if plan.action != "adapt":
        return plan

    def expected_s(lay: Layout, q: Sequence[int]) -> float:
        return share * iteration_s(lay, q, burst, hw) + (1.0 - share) * iteration_s(lay, q, calm, hw)

    now_s = expected_s(layout, quotas)
    then_s = expected_s(plan.layout, plan.quotas)
    why = (f"a rank slow in bursts {share:.0%} of the time: expected {then_s:.3f} s/iter with the plan, "
           f"{now_s:.3f} s/iter as it runs (bursts and calm weighed)")
    if then_s + plan.one_time_cost_s / horizon_iters < now_s:
        return dataclasses.replace(plan, iteration_s_before=now_s, iteration_s_after=then_s,
                                   reason=f"{plan.reason}; {why}")
    return Plan("keep", layout, tuple(quotas), (), now_s, now_s, 0.0,
                f"keep: {why}; the plan for the bursts ({plan.reason}) does not pay", policy=plan.policy)
