"""Side-by-side predictions: the ResiHP plan against every baseline and the capacity bound.

Responsible for turning plans into comparable samples/s figures: each policy's iteration time
after its change, with its one-time cost (regroup + moves, or a restart) spread over
``horizon_iters`` iterations. Used by the what-if CLI and the planner benchmark; it times nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp_ext.layout import Layout
from resihp_ext.planner.simple_policies import BASELINES, POLICIES
from resihp_ext.planner.cost import capacity_bound_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan


@dataclass(frozen=True)
class Comparison:
    """Our plan, its throughput, each baseline's throughput and the capacity bound (samples/s)."""

    plan: Plan
    predicted_throughput: float
    capacity_bound: float
    baselines: dict[str, float]
    baseline_plans: dict[str, Plan]


def compare(layout: Layout, health: Health, hw: HardwareModel | None = None, *, plan: Plan | None = None,
            num_microbatches: int | None = None, horizon_iters: int = 500) -> Comparison:
    """Predict samples/s of the ResiHP plan (given or computed) and of every baseline.

    Args:
        layout: the layout running now.
        health: the failure.
        hw: cost constants.
        plan: the ResiHP plan if already computed.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: iterations over which one-time costs are spread.

    Returns:
        A Comparison.
    """
    hw = hw or HardwareModel()
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    samples = num_mb * layout.model.micro_batch_size
    kwargs = dict(num_microbatches=num_mb, horizon_iters=horizon_iters)
    plan = plan or POLICIES["resihp"](layout, health, hw, **kwargs)
    others = {name: POLICIES[name](layout, health, hw, **kwargs) for name in BASELINES}
    bound_s = capacity_bound_s(layout, health, hw, num_mb)
    return Comparison(
        plan=plan,
        predicted_throughput=plan.throughput(samples, horizon_iters),
        capacity_bound=samples / bound_s,
        baselines={name: p.throughput(samples, horizon_iters) for name, p in others.items()},
        baseline_plans=others,
    )
