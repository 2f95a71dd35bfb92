"""ReCycle: a fail-stop's lost work rerouted into peer pipelines' bubbles.

Model of S. Gandhi, M. Zhao, A. Skiadopoulos, C. Kozyrakis, "ReCycle: Resilient Training of
Large DNNs using Pipeline Adaptation" (SOSP 2024). Rule: when a device of stage ``s`` in one
data-parallel pipeline fails, that pipeline keeps running its other stages, and its micro-batches'
stage-``s`` work is rerouted to stage ``s`` of the peer pipelines, which hold the same parameters.
Adaptive pipelining and decoupled back-propagation (weight gradients deferred) let the peers run
the extra work inside their pipeline bubbles; only what the bubbles cannot hold lengthens the
iteration. No fail-slow handling: slow devices stay where they are. When no peer holds a stage's
parameters any more, ReCycle cannot go on and the job restarts from a checkpoint.

Rerouting is not a Layout with quotas, so the iteration time is modelled from the cost model's
own per-stage seconds: each pipeline's 1F1B time under ``health`` (a failed stage priced at
healthy speed, since a peer runs its work), and for each peer that takes ``e`` extra micro-batches
at stage ``s``: its extra busy time ``e * (f_s + b_s)`` minus the bubble it can fill, which is
stage ``s``'s idle time in its own 1F1B iteration less the idle before its first forward (no
rerouted input exists before then either). The iteration is the slowest pipeline's time plus its
largest such excess, plus the gradient all-reduce.

Simplified, and why:
- Every bubble second after the first forward is counted as usable, and the memory the extra
  in-flight activations need is not checked: both favour ReCycle, so where it wins here it may
  not win on hardware.
- Rerouted micro-batches are spread over the healthy peers round-robin; the busiest takes the
  ceiling of the even share.
- Rerouting costs one regroup (``hw.regroup_s``); no state moves.
"""

from __future__ import annotations

import math

from resihp_ext.layout import Layout
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response, fail_slow_unhandled, start
from resihp_ext.planner.cost import allreduce_s, replica_timing
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan

NAME = "recycle"


def _same_stages(layout: Layout) -> bool:
    shapes = {tuple((st.first_layer, st.num_layers) for st in rep.stages) for rep in layout.replicas}
    return len(shapes) == 1


def recycle(layout: Layout, health: Health, hw: HardwareModel | None = None, *,
            num_microbatches: int | None = None, horizon_iters: int = 500,
            current_quotas: tuple[int, ...] | None = None) -> Response:
    """ReCycle's response to ``health``.

    Args:
        layout: the layout running now (identical pipelines, as ReCycle assumes).
        health: dead ranks, speeds, slow links.
        hw: cost constants.
        num_microbatches: micro-batches per global batch (default from the model).
        horizon_iters: unused (ReCycle does not weigh costs); kept for the shared signature.
        current_quotas: micro-batches per pipeline now (default: equal).

    Returns:
        A Response: keep (nothing dead), reroute, or checkpoint-restart.
    """
    at = start(layout, health, hw, num_microbatches, current_quotas)
    if not health.dead:
        return fail_slow_unhandled(NAME, layout, at)
    hw, num_mb, quotas, before_s = at.hw, at.num_microbatches, at.quotas, at.before_s
    if not _same_stages(layout):
        raise ValueError("ReCycle reroutes between identical pipelines; the layout's replicas differ")
    num_stages = layout.replicas[0].num_stages
    broken = [{r for r, rep in enumerate(layout.replicas) if set(rep.stages[s].ranks) & health.dead}
              for s in range(num_stages)]
    if any(len(b) == layout.num_replicas for b in broken):
        return checkpoint_restart(layout, health, hw, num_microbatches=num_mb, horizon_iters=horizon_iters)
    # a peer runs the failed stage's work at its own speed: price failed groups as healthy
    alive = Health(speed={r: v for r, v in health.speed.items() if r not in health.dead},
                   slow_links=health.slow_links)
    timings = [replica_timing(rep, layout.model, hw, alive) for rep in layout.replicas]
    worst_s, notes = 0.0, []
    for r, (timing, q) in enumerate(zip(timings, quotas)):
        own_s = timing.simulate_s(q)
        excess_s = 0.0
        for s, failed in enumerate(broken):
            if not failed or r in failed:
                continue
            rerouted = sum(quotas[d] for d in failed)
            extra = math.ceil(rerouted / (layout.num_replicas - len(failed)))
            step_s = timing.forward_s[s] + timing.backward_s[s]
            start_idle_s = sum(timing.forward_s[:s]) + sum(timing.p2p_s[:s])
            usable_s = max(0.0, own_s - q * step_s - start_idle_s)
            excess_s = max(excess_s, extra * step_s - usable_s)
        worst_s = max(worst_s, own_s + max(excess_s, 0.0))
    after_s = worst_s + allreduce_s(layout, hw, alive)
    for s, failed in enumerate(broken):
        if failed:
            notes.append(f"stage {s} of pipelines {sorted(failed)} rerouted to "
                         f"{layout.num_replicas - len(failed)} peers")
    return Response(NAME, Plan("adapt", layout, quotas, (), before_s, after_s, hw.regroup_s,
                               f"{NAME}: {'; '.join(notes)}; {after_s:.3f} s/iter (bubbles filled first)",
                               policy=NAME))
