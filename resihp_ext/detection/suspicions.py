"""The Suspicion values the fail-slow detector raises, and which healthy peers each one probes.

Responsible for building a ``Suspicion`` (its probe list, its readable reason) for a slow stage
group, a slow pipeline link, or a known slow group that runs faster again, from what the
detector has judged. Deciding *whether* to suspect is ``resihp_ext.detection.detector``'s job.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from resihp_ext.detection.observations import GroupId, LinkId, Suspicion
from resihp_ext.detection.op_signals import Streak


def reference_ranks(g: GroupId, group_ranks: Mapping[GroupId, tuple[int, ...]], avoid=(),
                    last_resort: Sequence[Collection[GroupId]] = (),
                    slowness: Mapping[GroupId, float] | None = None) -> tuple[int, ...]:
    """Ranks of a healthy group to probe beside ``g``: the same stage of another replica, else
    another stage (the GEMM probe is the same on every rank, so any healthy rank is a fair
    reference). Groups in ``avoid`` (muted, known slow) are not healthy references; those in one of
    ``last_resort``'s sets (e.g. in a run of slow iterations, suspected, known slow) only where no
    other group is left, a later set's after an earlier one's. Why: a re-plan unmutes every group, and live a rank 2x slow probed beside a
    device known 3x slow read as fast as it and was cleared; two ranks 3x slow in the same stage
    of two replicas, each the other's reference, cleared each other for the rest of the run.
    Among groups alike in all that, the one ``slowness`` (its latest suspect ratio) puts lowest
    comes first: live at TP 1, a rank 3x slow was cleared three times, its probe reading 1.00x its
    reference's, where the two groups left to choose from were both in a run of slow iterations, a
    healthy rank's of 1.26x readings (a busy host) and a 3x slow rank's on the suspect's own stage,
    which the stage preference took."""
    slowness = slowness or {}
    others = sorted((h for h in group_ranks if h != g and h not in avoid),
                    key=lambda h: (*(h in worse for worse in reversed(last_resort)), slowness.get(h, 0.0),
                                   h[1] != g[1], h))
    return group_ranks[others[0]] if others else ()


def reference_links(link: LinkId, links: Iterable[LinkId], rank_group: Mapping[int, GroupId],
                    limit: int) -> list[LinkId]:
    """Up to ``limit`` other links across the same stage boundary in the same direction: this
    replica's first (they carry the same activations), then other replicas'."""
    g, h = rank_group[link[0]], rank_group[link[1]]

    def same_boundary(other):
        a, b = rank_group.get(other[0]), rank_group.get(other[1])
        return a is not None and b is not None and (a[1], b[1]) == (g[1], h[1]) and a[0] == b[0]

    return sorted((other for other in links if other != link and same_boundary(other)),
                  key=lambda other: (rank_group[other[0]][0] != g[0], other))[:limit]


def compute_suspicion(iteration: int, g: GroupId, ranks: tuple[int, ...], reference: tuple[int, ...],
                      streak: Streak, ratio: float, signal: str, common: float, threshold: float) -> Suspicion:
    """Stage group ``g`` ran ``ratio`` x its prediction (``signal="predicted"``, beyond the
    ``common`` slowdown of the others), x the price of its plan (``"planned"``: it has no fitted
    cost model yet; beyond the others' ``common`` level against theirs) or x its TP siblings
    (``"siblings"``)."""
    beyond = f" beyond the {common:.2f}x most other groups ran" if signal != "siblings" and common != 1.0 else ""
    measure = {"predicted": f"its predicted compute time{beyond}",
               "planned": f"the compute time its plan priced{beyond and beyond + ' against theirs'}",
               "siblings": "in its slowest rank's compute against its TP siblings'"}[signal]
    unfitted = "; its stage shape has no fitted cost model yet" if signal == "planned" else ""
    return Suspicion(
        iteration=iteration,
        onset_iteration=streak.onset,
        kind="compute",
        replica=g[0],
        stage=g[1],
        ranks=ranks,
        links=(),
        probe_ranks=tuple(ranks) + tuple(reference),
        probe_links=(),
        ratio=ratio,
        reason=(
            f"replica {g[0]} stage {g[1]} (ranks {list(ranks)}) ran {ratio:.2f}x {measure}"
            f" for {streak.count} iterations since {streak.onset} (threshold {threshold}{unfitted})"
        ),
    )


def recovery_suspicion(iteration: int, g: GroupId, ranks: tuple[int, ...], known: Mapping[int, float],
                       reference: tuple[int, ...], streak: Streak, speedup: float) -> Suspicion:
    """Group ``g``, holding ranks with ``known`` slowdowns (rank -> factor), ran ``speedup`` x
    faster than they predict."""
    slow = tuple(r for r in ranks if r in known)
    slowdowns = ", ".join(f"{r}: {known[r]:.2f}x" for r in slow)
    return Suspicion(
        iteration=iteration, onset_iteration=streak.onset, kind="recovery", replica=g[0], stage=g[1],
        ranks=slow, links=(), probe_ranks=tuple(ranks) + tuple(reference), probe_links=(), ratio=speedup,
        reason=(f"replica {g[0]} stage {g[1]} (ranks {list(ranks)}) ran {speedup:.2f}x faster than its known "
                f"slowdown ({slowdowns}) predicts for {streak.count} iterations since {streak.onset}"),
    )


def bursts_ended_suspicion(iteration: int, g: GroupId, ranks: tuple[int, ...], in_bursts: Mapping[int, float],
                           reference: tuple[int, ...], calm_since: int) -> Suspicion:
    """Group ``g``, holding ranks known to be slow in bursts (``in_bursts``: rank -> burst factor),
    has run at full speed from ``calm_since`` on, for longer than its bursts ever stayed away: a
    recovery suspicion, which probes of the group confirm."""
    slow = tuple(r for r in ranks if r in in_bursts)
    bursts = ", ".join(f"{r}: {in_bursts[r]:.2f}x" for r in slow)
    return Suspicion(
        iteration=iteration, onset_iteration=calm_since, kind="recovery", replica=g[0], stage=g[1],
        ranks=slow, links=(), probe_ranks=tuple(ranks) + tuple(reference), probe_links=(), ratio=1.0,
        reason=(f"replica {g[0]} stage {g[1]} (ranks {list(ranks)}), known to be slow in bursts ({bursts}), "
                f"has had none for {iteration - calm_since + 1} iterations since {calm_since}"),
    )


def link_suspicion(iteration: int, link: LinkId, sender: GroupId, receiver: GroupId, references: list[LinkId],
                   streak: Streak, ratio: float, common: float) -> Suspicion:
    """Transfers over ``link`` (from group ``sender`` to ``receiver``) took ``ratio`` x their
    healthy time, beyond the ``common`` slowdown of the other links."""
    beyond = f" beyond the {common:.2f}x most other links took" if common > 1.0 else ""
    return Suspicion(
        iteration=iteration,
        onset_iteration=streak.onset,
        kind="link",
        replica=sender[0],
        stage=min(sender[1], receiver[1]),
        ranks=tuple(link),
        links=(link,),
        probe_ranks=(),
        probe_links=(link, *references),
        ratio=ratio,
        reason=(
            f"transfer {link[0]}->{link[1]} took {ratio:.2f}x its healthy time{beyond} for {streak.count} "
            f"iterations since {streak.onset}"
        ),
    )
