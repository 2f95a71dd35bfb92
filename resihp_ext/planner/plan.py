"""The planner's output: a frozen Plan with its Layout, quotas, state transfers and reason.

Responsible for the value the executor consumes and the log prints. A Plan carries the transfers
(``resihp_ext.shard_map.Transfer``, priced) that turn the running layout's state placement into
its layout's: one unit of one item (weights plus optimizer state) from a rank that holds it to a
rank that needs it, local copies included; after a fail-stop the source is always a surviving
rank, possibly in another replica. The executor runs exactly these, every one before any rank
drops or overwrites state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from resihp_ext.layout import Layout
from resihp_ext.shard_map import Transfer

Action = Literal["keep", "adapt", "checkpoint-restart"]
ACTIONS = ("keep", "adapt", "checkpoint-restart")


def _finite(value: float) -> float | None:
    # JSON has no infinity; a stalled job's iteration time is reported as null
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Plan:
    """A decision: keep, adapt in place, or fall back to checkpoint-restart.

    Attributes:
        action: "keep" (nothing changes), "adapt" (apply layout/quotas/moves in place) or
            "checkpoint-restart" (no in-place plan exists or pays off).
        layout: the layout to run next (for checkpoint-restart, the one to restart with, or None).
        quotas: micro-batches per replica of ``layout``, summing to the global batch's count.
        transfers: the state transfers to run before resuming (``shard_map.transfers`` from the
            running layout to ``layout``, priced; local copies included), empty when the layout
            stays.
        iteration_s_before: predicted iteration seconds if nothing changes (inf: the job stalls).
        iteration_s_after: predicted iteration seconds under this plan.
        one_time_cost_s: seconds the change itself costs (regroup + transfers, or a restart).
        reason: a sentence a person can read in the log.
        spare_ranks: healthy ranks the plan leaves idle.
        policy: the policy that produced the plan.
    """

    action: Action
    layout: Layout | None
    quotas: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    iteration_s_before: float
    iteration_s_after: float
    one_time_cost_s: float
    reason: str
    spare_ranks: tuple[int, ...] = ()
    policy: str = "resihp"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"plan action must be one of {ACTIONS}, got {self.action!r}")
        if self.layout is not None and len(self.quotas) != self.layout.num_replicas:
            raise ValueError(f"{len(self.quotas)} quotas for {self.layout.num_replicas} replicas; give one per replica")

    @property
    def moves(self) -> tuple[Transfer, ...]:
        """The transfers between two ranks (what costs link time)."""
        return tuple(t for t in self.transfers if t.crosses)

    @property
    def num_bytes_moved(self) -> int:
        return sum(m.num_bytes for m in self.moves)

    def throughput(self, samples_per_iteration: int, horizon_iters: int) -> float:
        """Samples/s averaged over ``horizon_iters`` iterations, the one-time cost included."""
        total_s = horizon_iters * self.iteration_s_after + self.one_time_cost_s
        return samples_per_iteration * horizon_iters / total_s if math.isfinite(total_s) and total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "action": self.action,
            "layout": self.layout.to_dict() if self.layout is not None else None,
            "quotas": list(self.quotas),
            "transfers": [t.to_dict() for t in self.transfers],
            "num_bytes_moved": self.num_bytes_moved,
            "iteration_s_before": _finite(self.iteration_s_before),
            "iteration_s_after": _finite(self.iteration_s_after),
            "one_time_cost_s": _finite(self.one_time_cost_s),
            "spare_ranks": list(self.spare_ranks),
            "reason": self.reason,
        }
