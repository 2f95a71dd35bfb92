"""Validation outcomes: probe localisation, Verdict/Cleared values, fail-stop judgement.

When the detector suspects a group, each suspect rank times a fixed GEMM on its own and each
suspect link times a fixed p2p transfer, with nothing else running, so data-dependent costs and
collective waits drop out. This module turns those timings into slow ranks/links and a slowdown
factor (probe time over the median healthy probe time). It also holds the values a suspicion
concludes to (``Verdict``, ``Cleared``) and the heartbeat judgement behind fail-stop verdicts,
so that the detector proper keeps only the per-iteration judgement. Running the probes is the training front
end's job; this module must never time anything, read clocks or touch process groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


@dataclass(frozen=True)
class ProbeResults:
    """Timings of one round of validation probes.

    Attributes:
        iteration: training iteration after which the probes ran.
        rank_s: seconds of the fixed GEMM probe per rank.
        link_s: seconds of the fixed p2p probe per directed link ``(src, dst)``.
        unresponsive: ranks that did not answer the probe round (dead or hung).
    """

    iteration: int
    rank_s: Mapping[int, float] = field(default_factory=dict)
    link_s: Mapping[tuple[int, int], float] = field(default_factory=dict)
    unresponsive: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for name, table in (("rank_s", self.rank_s), ("link_s", self.link_s)):
            bad = {k: v for k, v in table.items() if not (v > 0 and np.isfinite(v))}
            if bad:
                raise ValueError(f"probe {name} must be positive finite seconds; bad entries {bad}")


@dataclass(frozen=True)
class Localisation:
    """What the probes say.

    Attributes:
        slow_ranks: ranks whose probe is at least ``threshold`` times the healthy median.
        rank_factors: probe time / healthy median, for every probed rank.
        slow_links: links whose probe is at least ``threshold`` times the healthy median.
        link_factors: probe time / healthy median, for every probed link.
        unresponsive: ranks that did not answer.
        reason: one readable line.
        rank_reference_s: the healthy GEMM probe seconds the rank factors divide by (None: no rank
            was probed).
        link_reference_s: the healthy p2p probe seconds the link factors divide by (None: no link
            was probed).
    """

    slow_ranks: tuple[int, ...]
    rank_factors: Mapping[int, float]
    slow_links: tuple[tuple[int, int], ...]
    link_factors: Mapping[tuple[int, int], float]
    unresponsive: tuple[int, ...]
    reason: str
    rank_reference_s: float | None = None
    link_reference_s: float | None = None


def _factors(times: Mapping, threshold: float, reference_s: float | None) -> tuple[dict, list, float | None]:
    if not times:
        return {}, [], reference_s
    keys = list(times)
    values = np.array([times[k] for k in keys], dtype=float)
    if reference_s is None:
        # Two passes: the first median may include the slow ones; the second uses only probes
        # within the threshold of it, so one slow rank of two cannot drag the reference.
        first = float(np.median(values))
        healthy = values[values < threshold * first]
        reference_s = float(np.median(healthy)) if healthy.size else first
    factors = {k: float(v / reference_s) for k, v in zip(keys, values)}
    return factors, _slowest_first(factors, threshold), reference_s


def _own_baseline_factors(times: Mapping[int, float], threshold: float,
                          baselines_s: Mapping[int, float]) -> tuple[dict, list, float]:
    factors = {r: float(v / baselines_s[r]) for r, v in times.items()}
    return factors, _slowest_first(factors, threshold), float(np.median([baselines_s[r] for r in times]))


def _slowest_first(factors: Mapping, threshold: float) -> list:
    return sorted((k for k, f in factors.items() if f >= threshold), key=lambda k: -factors[k])


def peer_reference_s(times: Mapping[int, float], suspects: Sequence[int], threshold: float) -> float | None:
    """The median probe time of the healthy probed ranks outside ``suspects`` (the peers a
    suspicion probes beside its group), or None when there are none.

    A peer may be slow itself: when a stage is slow in every replica, the group probed beside one
    replica's slow group is the other replica's, whose slow rank is not yet suspected. So, as in
    ``localise``'s own reference, peers ``threshold`` times the peers' median or more are left
    out. Live (Megatron's loop, both replicas' first stage 3x slow at one rank each), the median
    of a slow and a healthy peer sat halfway and a 3x slow suspect read 1.46-1.52x; the plan made
    from that gave the other slow replica more micro-batches and ran slower than no plan.

    Suspects are compared with their peers, not with a median they take part in: with one suspect
    and one peer (TP 1), or a whole suspect group as large as its peer group (a node-wide slowdown
    of a TP group), that median sits halfway between slow and healthy, so a probe threshold of
    1.2 could not name anything slower by less than 1.5x (``t / (2 - t)``). Live, a 1.4x slow rank
    at TP 1 or a 1.4x slow TP group at TP 2 read 1.15-1.20x against it and was cleared round after
    round; against its peers it is named at 1.34-1.46x.
    """
    peers = np.array([t for r, t in times.items() if r not in suspects], dtype=float)
    if not peers.size:
        return None
    first = float(np.median(peers))
    healthy = peers[peers < threshold * first]
    return float(np.median(healthy)) if healthy.size else first


def pass_normalised_times(samples: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """Each subject's seconds in one probe round, with the speed each pass ran at divided out.

    ``samples`` holds each subject's sample of every pass, in pass order (subjects take turns
    within a pass, so a pass's samples are close in time). A pass's level is the median of its
    samples; a subject's seconds are the median over passes of its sample over that pass's level,
    times the median level. A subject is then judged against the others as they ran at the same
    moments, and a lone fast or slow sample moves nothing. Each subject's fastest sample did not
    do: a shared host's core ran a fixed GEMM at ~4.2 ms with now and then a sample at ~2.9 ms, and
    whichever subject drew such a sample read the other up to 1.8x slow (two healthy ranks probed
    in turn on one core: 6 of 150 rounds 1.2x apart or more). With one subject its seconds are
    its median sample.
    Subjects with fewer samples than the others (none: ``[]``) are left out.
    """
    passes = max((len(v) for v in samples.values()), default=0)
    full = {k: [float(x) for x in v] for k, v in samples.items() if len(v) == passes and passes > 0}
    if not full:
        return {}
    levels = [float(np.median([v[p] for v in full.values()])) for p in range(passes)]
    scale = float(np.median(levels))
    return {k: float(np.median([v[p] / levels[p] for p in range(passes)])) * scale for k, v in full.items()}


def undecided(times: Mapping, threshold: float, suspects: Sequence[int] = ()) -> bool:
    """Whether a probe round neither names a slow one nor shows its probes alike: none reaches
    ``threshold`` times the round's reference (the suspects' peers' median when ``suspects`` and
    peers are given), yet the slowest is ``threshold`` times the fastest.

    Such a round measured the host more than the devices. Live, 8 ranks on 2 cores, a round whose
    healthy probes read 4.62, 5.64 and 5.67 ms put a 1.5x slow rank's 6.72 ms at 1.19x their median
    and cleared it; in the rounds before and after, healthy probes agreed within 2-7%.
    """
    if len(times) < 2:
        return False
    _, slow, _ = _factors(times, threshold, peer_reference_s(times, suspects, threshold) if suspects else None)
    return not slow and max(times.values()) >= threshold * min(times.values())


def localise(
    probes: ProbeResults,
    threshold: float,
    rank_reference_s: float | None = None,
    link_reference_s: float | None = None,
    rank_baselines_s: Mapping[int, float] | None = None,
) -> Localisation:
    """Name the slow ranks and links in one probe round.

    Args:
        probes: the probe timings.
        threshold: a probe this many times the healthy median (or more) is slow (> 1).
        rank_reference_s: known healthy GEMM probe seconds; default: the median of this round's
            probes (probe a few ranks outside the suspect group so the median is healthy).
        link_reference_s: known healthy p2p probe seconds; default: median of this round's.
        rank_baselines_s: each rank's own healthy GEMM probe seconds. When every probed rank has
            one, each rank is compared with its own (for a round with no healthy peer to compare
            with, such as a one-rank job's); ``rank_reference_s`` is then ignored and the
            Localisation's ``rank_reference_s`` is the median of the baselines used.

    Returns:
        A ``Localisation``; slow ranks and links are ordered slowest first.
    """
    if threshold <= 1.0:
        raise ValueError(f"probe threshold must be > 1.0 (a slowdown ratio), got {threshold}")
    if rank_baselines_s and probes.rank_s and all(r in rank_baselines_s for r in probes.rank_s):
        rank_factors, slow_ranks, rank_reference_s = _own_baseline_factors(probes.rank_s, threshold, rank_baselines_s)
    else:
        rank_factors, slow_ranks, rank_reference_s = _factors(probes.rank_s, threshold, rank_reference_s)
    link_factors, slow_links, link_reference_s = _factors(probes.link_s, threshold, link_reference_s)
    parts = []
    if slow_ranks:
        parts.append("slow ranks " + ", ".join(f"{r} ({rank_factors[r]:.2f}x)" for r in slow_ranks))
    if slow_links:
        parts.append("slow links " + ", ".join(f"{a}->{b} ({link_factors[(a, b)]:.2f}x)" for a, b in slow_links))
    if probes.unresponsive:
        parts.append(f"unresponsive ranks {sorted(probes.unresponsive)}")
    reason = "; ".join(parts) if parts else (
        f"all {len(rank_factors)} rank probes and {len(link_factors)} link probes within {threshold:.2f}x of the median"
    )
    return Localisation(
        slow_ranks=tuple(slow_ranks),
        rank_factors=rank_factors,
        slow_links=tuple(slow_links),
        link_factors=link_factors,
        unresponsive=tuple(sorted(probes.unresponsive)),
        reason=reason,
        rank_reference_s=rank_reference_s,
        link_reference_s=link_reference_s,
    )


class VerdictKind(str, Enum):
    """What a verdict says failed. A ``str`` enum: events and traces write its value."""

    COMPUTE = "compute"  # a rank computes persistently slower
    LINK = "link"  # transfers from one rank to another run persistently slower
    DEAD = "dead"  # a rank stopped sending heartbeats
    HANG = "hang"  # a rank beats but makes no progress
    RECOVERED = "recovered"  # a known slow rank is faster again

    def __str__(self) -> str:
        return self.value

    @property
    def fail_slow(self) -> bool:
        """Whether a re-plan acts on it: what slowed down, and what is fast again."""
        return self in (VerdictKind.COMPUTE, VerdictKind.LINK, VerdictKind.RECOVERED)


@dataclass(frozen=True)
class Verdict:
    """A confirmed failure.

    The typed fields are what code acts on; ``evidence`` is the record for people and traces.

    Attributes:
        kind: a ``VerdictKind`` (a plain string naming one is converted); ``recovered``: a known
            slow rank is faster again, ``factor`` is its slowdown now, 1.0 when healthy.
        ranks: afflicted ranks (for a link: sender and receiver).
        factor: estimated slowdown (probe time / healthy median), None for dead/hang.
        iteration: iteration the verdict applies from.
        evidence: numbers behind it (ratios, probe factors), JSON-ready.
        reason: one readable line.
        probe_factors: each named rank's probed slowdown (compute and recovered verdicts); a rank
            missing from it runs at ``factor``.
        intermittent: the ranks are slow in bursts, at full speed between them; their factors are
            the burst slowdown.
        slow_share: for an intermittent verdict, the share of its group's iterations that ran slow
            (None: not measured, or not intermittent).
    """

    kind: VerdictKind
    ranks: tuple[int, ...]
    factor: float | None
    iteration: int
    evidence: Mapping = field(default_factory=dict)
    reason: str = ""
    probe_factors: Mapping[int, float] = field(default_factory=dict)
    intermittent: bool = False
    slow_share: float | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", VerdictKind(self.kind))
        except ValueError:
            raise ValueError(f"verdict kind must be compute|link|dead|hang|recovered, got {self.kind!r}") from None
        # A plain dict, not a read-only view: verdicts travel pickled from the decider to every rank.
        object.__setattr__(self, "probe_factors", {int(r): float(f) for r, f in self.probe_factors.items()})
        if self.slow_share is not None and not 0.0 <= self.slow_share <= 1.0:
            raise ValueError(f"slow_share must be in [0, 1], got {self.slow_share}")

    def factor_of(self, rank: int) -> float:
        """``rank``'s slowdown: its probe factor, else the verdict's (1.0 when it has none)."""
        return self.probe_factors.get(rank, self.factor if self.factor is not None else 1.0)

    def to_event(self) -> dict:
        """JSON-ready event (the caller adds ``"time"``)."""
        return {
            "event": "verdict",
            "kind": self.kind.value,
            "ranks": list(self.ranks),
            "factor": None if self.factor is None else round(self.factor, 4),
            "iteration": self.iteration,
            "reason": self.reason,
            "evidence": dict(self.evidence),
        }


@dataclass(frozen=True)
class Cleared:
    """Validation found nothing: the suspicion is dropped and nobody acts."""

    iteration: int
    ranks: tuple[int, ...]
    evidence: Mapping = field(default_factory=dict)
    reason: str = ""
    probe_factors: Mapping[int, float] = field(default_factory=dict)  # as a Verdict's: the suspects' probes

    def __post_init__(self) -> None:
        object.__setattr__(self, "probe_factors", {int(r): float(f) for r, f in self.probe_factors.items()})

    def to_event(self) -> dict:
        """JSON-ready event (the caller adds ``"time"``)."""
        return {
            "event": "cleared",
            "iteration": self.iteration,
            "ranks": list(self.ranks),
            "reason": self.reason,
            "evidence": dict(self.evidence),
        }


def judge_heartbeats(now: float, last_beat: Mapping[int, float], timeout_s: float) -> frozenset[int]:
    """Ranks whose latest heartbeat is older than ``timeout_s`` at time ``now``.

    Args:
        now: current time on the same clock as the heartbeats (seconds).
        last_beat: rank -> timestamp of its latest heartbeat.
        timeout_s: maximum heartbeat age (``--resihp-heartbeat-timeout-s``).

    Returns:
        The ranks judged dead.
    """
    if timeout_s <= 0:
        raise ValueError(f"--resihp-heartbeat-timeout-s must be > 0, got {timeout_s}")
    return frozenset(rank for rank, beat in last_beat.items() if now - beat > timeout_s)


def fail_stop_verdict(kind: str, ranks: Sequence[int], iteration: int, detail: str = "") -> Verdict:
    """A ``dead`` (no heartbeat) or ``hang`` (heartbeat but no progress) verdict."""
    if kind not in (VerdictKind.DEAD, VerdictKind.HANG):
        raise ValueError(f"fail-stop verdicts are dead|hang, got {kind!r}")
    what = "stopped sending heartbeats" if kind == "dead" else "stopped making progress"
    ranks = tuple(sorted(ranks))
    return Verdict(kind, ranks, None, iteration, {}, f"ranks {list(ranks)} {what}" + (f" ({detail})" if detail else ""))
