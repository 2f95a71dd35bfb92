"""Models of peer systems' policies, for comparing ResiHP against them under one cost model.

Responsible for the registry ``POLICIES``: name -> function ``(layout, health, hw, *,
num_microbatches, horizon_iters) -> Response``. Each peer lives in its own module whose
docstring names its paper, the rule it implements and what is simplified; every one is scored
by ``resihp_ext.planner.cost`` (the model our own planner uses), and none is built from our
planner's search. ``scenarios`` draws the failures of the evaluation and ``timeline`` runs a
policy through failures arriving over a long run. Pure: no torch, no megatron, no I/O.
"""

from __future__ import annotations

from typing import Callable

from resihp_ext.layout import Layout
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.greyhound import greyhound
from resihp_ext.peers.ntp import ntp
from resihp_ext.peers.oobleck import oobleck
from resihp_ext.peers.recycle import recycle
from resihp_ext.peers.response import Response, from_plan
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation

OURS = "resihp"


def resihp(layout: Layout, health: Health, hw: HardwareModel | None = None, *, num_microbatches: int | None = None,
           horizon_iters: int = 500) -> Response:
    """Our policy, ``planner.joint.plan_adaptation``, as a Response."""
    return from_plan(plan_adaptation(layout, health, hw, num_microbatches=num_microbatches,
                                     horizon_iters=horizon_iters), OURS)


Policy = Callable[..., Response]
POLICIES: dict[str, Policy] = {
    OURS: resihp,
    "recycle": recycle,
    "oobleck": oobleck,
    "greyhound": greyhound,
    "ntp": ntp,
    "checkpoint-restart": checkpoint_restart,
}
PEERS = tuple(name for name in POLICIES if name != OURS)

__all__ = ["OURS", "PEERS", "POLICIES", "Response", "resihp"]
