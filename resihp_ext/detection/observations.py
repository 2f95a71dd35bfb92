"""The values detection works on: what one rank measured, what the detector suspects, and its
per-iteration report.

Responsible for the plain, frozen data that crosses the line between the live loop (which
measures) and ``resihp_ext.detection.detector`` (which decides). Values validate themselves; nothing here
decides anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OpRecord = tuple[str, int, float, float]
GroupId = tuple[int, int]  # (replica, stage)
LinkId = tuple[int, int]  # (src rank, dst rank)


@dataclass(frozen=True, slots=True)
class RankObservation:
    """What one rank measured in one iteration; the live loop builds one per rank per iteration.

    Attributes:
        rank: global rank.
        replica: data-parallel replica index of the rank.
        stage: pipeline stage of the rank within its replica.
        tp_rank: rank within its tensor-parallel group.
        ops: per forward/backward executed, ``(kind, microbatch, start_s, end_s)`` with kind
            ``"F"`` or ``"B"``; times in seconds from the rank's iteration start, start taken after
            the op's inputs arrived (pipeline receive waits are outside the op).
        features: per micro-batch of the replica, ``(num_tokens, sum_sq, num_docs)`` of its
            documents (``(num_tokens, sum_sq)`` is read as having no document count).
        iteration_s: the rank's wall-clock iteration time.
        busy: per op in ``ops``, the seconds the device worked on it (CPU time of the rank's
            thread when ranks share CPU cores). Empty: the op's wall duration is its busy time.
    """

    rank: int
    replica: int
    stage: int
    tp_rank: int
    ops: tuple[OpRecord, ...]
    features: tuple[tuple[int, ...], ...]
    iteration_s: float
    busy: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if min(self.rank, self.replica, self.stage, self.tp_rank) < 0:
            raise ValueError(f"rank/replica/stage/tp_rank must be >= 0 in observation of rank {self.rank}")
        for kind, mb, start, end in self.ops:
            if kind not in ("F", "B") or not 0 <= mb < len(self.features) or end < start:
                raise ValueError(
                    f"rank {self.rank}: bad op {(kind, mb, start, end)}; need kind 'F'|'B', a micro-batch "
                    f"with features (0..{len(self.features) - 1}) and end_s >= start_s"
                )
        if not self.iteration_s > 0:
            raise ValueError(f"rank {self.rank}: iteration_s must be > 0, got {self.iteration_s}")
        if any(len(f) not in (2, 3) for f in self.features):
            raise ValueError(f"rank {self.rank}: micro-batch features are (num_tokens, sum_sq[, num_docs])")
        if self.busy and (len(self.busy) != len(self.ops) or min(self.busy) < 0):
            raise ValueError(f"rank {self.rank}: busy needs one time >= 0 per op ({len(self.ops)}), "
                             f"got {len(self.busy)}")

    def op_busy(self) -> tuple[float, ...]:
        """Per op, the device seconds it took (its wall duration when no busy time was measured)."""
        return self.busy or tuple(end - start for _, _, start, end in self.ops)


@dataclass(frozen=True)
class Suspicion:
    """A persistent slowdown that needs validation probes before anyone acts on it.

    Attributes:
        iteration: iteration at which the slowdown became persistent.
        onset_iteration: first iteration of the slow streak.
        kind: ``"compute"`` (a stage group), ``"link"`` (a pipeline transfer) or ``"recovery"``
            (a group holding a known slow rank runs faster than that slowdown predicts).
        replica: DP replica of the suspect group or link.
        stage: the suspect stage (for a link, its sending side's lower stage).
        ranks: suspect ranks.
        links: suspect directed links ``(src, dst)`` (empty for compute).
        probe_ranks: ranks that should run the GEMM probe (suspects plus healthy references).
        probe_links: links that should run the p2p probe (suspects plus healthy references).
        ratio: observed / predicted at ``iteration``.
        reason: one readable line.
    """

    iteration: int
    onset_iteration: int
    kind: str
    replica: int
    stage: int
    ranks: tuple[int, ...]
    links: tuple[LinkId, ...]
    probe_ranks: tuple[int, ...]
    probe_links: tuple[LinkId, ...]
    ratio: float
    reason: str

    def to_event(self) -> dict:
        """JSON-ready event (the caller adds ``"time"``)."""
        return {
            "event": "suspicion",
            "kind": self.kind,
            "iteration": self.iteration,
            "onset_iteration": self.onset_iteration,
            "replica": self.replica,
            "stage": self.stage,
            "ranks": list(self.ranks),
            "links": [list(link) for link in self.links],
            # What the probes will compare the suspects with: a slow reference would clear them.
            "probe_ranks": list(self.probe_ranks),
            "probe_links": [list(link) for link in self.probe_links],
            "ratio": round(self.ratio, 4),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class DetectorReport:
    """What the detector computed for one iteration (for logs and benchmarks).

    Attributes:
        iteration: the iteration.
        judged: False while warming up (fitting only); after it, a group is judged on its prediction
            once its stage configuration's model is fitted.
        stage_ratio: observed / predicted compute per ``(replica, stage)``.
        rank_ratio: the same per rank, from the rank's own op times.
        sibling_ratio: per group of two or more TP ranks, its slowest rank's busy time over the
            median of the others' (they run the same ops on the same data).
        planned_ratio: per group judged on its plan's price (one rank, a stage shape of its own, no
            fitted cost model yet; ``FailSlowDetector.plan``): its compute over that price, beyond
            the other groups'.
        link_ratio: observed / baseline transfer per directed link.
        predicted_iteration_s: predicted iteration time (None until fitted), made before learning
            from this iteration.
        observed_iteration_s: median of the ranks' iteration times.
    """

    iteration: int
    judged: bool
    stage_ratio: Mapping[GroupId, float]
    rank_ratio: Mapping[int, float]
    link_ratio: Mapping[LinkId, float]
    predicted_iteration_s: float | None
    observed_iteration_s: float
    sibling_ratio: Mapping[GroupId, float] = field(default_factory=dict)
    planned_ratio: Mapping[GroupId, float] = field(default_factory=dict)
