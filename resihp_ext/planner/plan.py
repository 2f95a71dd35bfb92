"""The planner's output: a frozen Plan with its Layout, quotas, state moves and reason.

Responsible for the value the executor consumes and the log prints. A Move names one piece of
model state (one finest TP shard of one layer, weights plus optimizer state) to copy from a rank
that holds it to a rank that needs it; after a fail-stop the source is always a surviving rank,
possibly in another replica. Sources send what they held under the old layout, so the executor
performs every move before any rank drops or overwrites state. Layer index -1 is the word/position
embedding (first stage) and ``num_layers`` the output layer (last stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from resihp_ext.layout import Layout

Action = Literal["keep", "adapt", "checkpoint-restart"]
ACTIONS = ("keep", "adapt", "checkpoint-restart")


@dataclass(frozen=True)
class Move:
    """Copy finest shard ``shard`` (of ``shard_degree``) of ``layer`` from ``src_rank`` to ``dst_rank``.

    ``kind`` is "layer" when the destination held no part of the layer before (repartition) and
    "tp_shard" when it held another shard of it (TP regrouping).
    """

    kind: Literal["layer", "tp_shard"]
    layer: int
    shard: int
    shard_degree: int
    src_rank: int
    dst_rank: int
    num_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "layer": self.layer, "shard": self.shard, "shard_degree": self.shard_degree,
                "src_rank": self.src_rank, "dst_rank": self.dst_rank, "num_bytes": self.num_bytes}


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
        moves: state copies to perform before resuming.
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
    moves: tuple[Move, ...]
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
            "moves": [m.to_dict() for m in self.moves],
            "num_bytes_moved": self.num_bytes_moved,
            "iteration_s_before": _finite(self.iteration_s_before),
            "iteration_s_after": _finite(self.iteration_s_after),
            "one_time_cost_s": _finite(self.one_time_cost_s),
            "spare_ranks": list(self.spare_ranks),
            "reason": self.reason,
        }
