"""Models of peer systems' policies, for comparing ResiHP against them under one cost model.

Responsible for the registry ``POLICIES``: name -> function ``(layout, health, hw, *,
num_microbatches, horizon_iters) -> Response``. Each peer lives in its own module whose
docstring names its paper, the rule it implements and what is simplified; every one is scored
by ``resihp_ext.planner.cost`` (the model our own planner uses), and none is built from our
planner's search. Our own two policies are in ``ours``. ``scenarios`` draws the failures of the
evaluation and ``timeline`` runs a policy through failures arriving over a long run. Pure: no
torch, no megatron, no I/O.
"""

from __future__ import annotations

from typing import Callable

from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.greyhound import greyhound
from resihp_ext.peers.ntp import ntp
from resihp_ext.peers.oobleck import oobleck
from resihp_ext.peers.recycle import recycle
from resihp_ext.peers.ours import IN_PLACE, OURS, resihp, resihp_in_place
from resihp_ext.peers.response import Response

Policy = Callable[..., Response]
POLICIES: dict[str, Policy] = {
    OURS: resihp,
    IN_PLACE: resihp_in_place,
    "recycle": recycle,
    "oobleck": oobleck,
    "greyhound": greyhound,
    "ntp": ntp,
    "checkpoint-restart": checkpoint_restart,
}
PEERS = tuple(name for name in POLICIES if name not in (OURS, IN_PLACE))

__all__ = ["IN_PLACE", "OURS", "PEERS", "POLICIES", "Response", "resihp", "resihp_in_place"]
