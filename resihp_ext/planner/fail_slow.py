"""What a fail-slow re-plan decides from confirmed verdicts.

Responsible for the decision half of an in-place fail-slow re-plan: the planner's view of each
verdict (``verdict_health``), the health every later plan starts from (``known``: every slowdown
acted on so far in this world), the health between the bursts of a rank slow only in bursts
(``calm``), the plan itself (joint planner, then weighed over bursts and calm), what the detector
takes as the norm afterwards, and what it must watch again when the layout stays. It also holds
the cost model a live re-plan prices changes with (``live_hardware``), including the estimate of
what re-forming the groups costs.

Pure: reads typed verdict fields, never evidence records; no clocks, no process groups. The
executor applies what ``decide_fail_slow`` returns and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from resihp_ext.detection.validation import Verdict, VerdictKind
from resihp_ext.layout import Layout, replica_shape
from resihp_ext.planner.adaptation_check import RejectedPlans
from resihp_ext.planner.bursts import weigh_bursts
from resihp_ext.planner.calibration import ComputeCosts
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.schedule import Interleaving
from resihp_ext.planner.plan import Plan

# The fixed seconds a live plan charges for re-forming the groups of the processes it already has
# (no restart, no checkpoint): the in-place re-form rebuilds groups over the job's own store and
# rebuilds model and optimizer on each rank, a far smaller step than the reference cluster's
# ``HardwareModel.regroup_s`` (a re-form of a large job). Moves are priced on top, per byte.
IN_PLACE_REGROUP_S = 0.5


def live_hardware(costs: ComputeCosts | None, half_precision: bool,
                  link_bandwidth_Bps: float | None = None, interleaving: Interleaving = Interleaving()) -> HardwareModel:
    """The cost model a live re-plan uses: fitted to this job when it has been measured.

    Args:
        costs: the compute costs the decider fitted to a measured iteration (None: none yet, the
            reference costs stand).
        half_precision: the parameters are bf16/fp16 (activations cross stages at 2 bytes a value).
        link_bandwidth_Bps: the healthy links' bandwidth a link probe round measured (None: the
            default bandwidth; every candidate then crosses the same healthy links).
        interleaving: the replicas' pipeline schedule.

    Returns:
        A ``HardwareModel`` with ``regroup_s`` at ``IN_PLACE_REGROUP_S``.
    """
    facts: dict = {"activation_bytes_per_value": 2.0 if half_precision else 4.0, "regroup_s": IN_PLACE_REGROUP_S,
                   "interleaving": interleaving}
    if link_bandwidth_Bps is not None:
        facts["link_bandwidth_Bps"] = link_bandwidth_Bps
    return HardwareModel(**facts) if costs is None else costs.hardware(**facts)


def verdict_health(verdict: Verdict) -> Health:
    """The planner's view of a fail-slow verdict: each slow rank's speed, or the slow link's; for a
    ``recovered`` verdict, the rank's speed now (1.0 when healthy again).

    Raises:
        ValueError: ``verdict`` is not a fail-slow verdict (dead and hang go to fail-stop recovery).
    """
    if not verdict.kind.fail_slow:
        raise ValueError(f"a {verdict.kind} verdict is not a fail-slow one; fail-stop recovery plans for it")
    if verdict.kind is VerdictKind.LINK:
        src, dst = verdict.ranks
        return Health(slow_links={(src, dst): 1.0 / max(verdict.factor or 1.0, 1.0)})
    return Health(speed={r: 1.0 / max(verdict.factor_of(r), 1.0) for r in verdict.ranks},
                  bursts=frozenset(verdict.ranks) if verdict.intermittent else frozenset())


@dataclass(frozen=True)
class FailSlowDecision:
    """What the executor does after fail-slow verdicts.

    Attributes:
        plan: "adapt" (apply ``plan.layout`` and ``plan.quotas``) or a Plan that keeps the layout.
        known: the health every later plan in this world starts from.
        expected: the slowdowns the detector takes as the norm from now on (bursts included).
        watch_ranks: with the layout kept, the ranks whose groups the detector judges again, so
            that a rank that slows further (or recovers) is seen.
        watch_links: likewise for links, judged against their slow speed.
    """

    plan: Plan
    known: Health
    expected: Health
    watch_ranks: tuple[int, ...] = ()
    watch_links: tuple[tuple[int, int], ...] = ()


def misjudged(health: Health, factors: Mapping[int, float]) -> Health:
    """``health`` as a cost model fed false speeds sees it: each rank of ``factors`` runs ``factor``
    times slower than ``health`` says, a healthy one included (``misjudge:`` faults, which test
    that a re-plan that does not pay is undone)."""
    if not factors:
        return health
    speed = dict(health.speed)
    for rank, factor in factors.items():
        if rank not in health.dead:
            speed[rank] = health.speed_of(rank) / factor
    return dataclasses.replace(health, speed=speed)


def decide_fail_slow(layout: Layout, known: Health, verdicts: Sequence[Verdict], hw: HardwareModel,
                     quotas: Sequence[int], horizon_iters: int, launch_shape: tuple,
                     rejected: RejectedPlans = RejectedPlans(),
                     misjudge: Mapping[int, float] | None = None, stages_fixed: bool = False,
                     stages_alike: bool = False, ranks_fixed: bool = False, tp_exclusion: bool = False,
                     drop_to: Iterable[int] | None = None) -> FailSlowDecision:
    """Plan for ``verdicts`` on top of every slowdown already ``known``.

    The plan sees every slowdown found so far, not only these verdicts', so quotas moved away from
    an earlier slow rank stay away when another one slows. A verdict of a rank slow in bursts is
    planned for during a burst and weighed against the calm between bursts for the share of
    iterations the bursts take (the largest share of several; an unknown share counts as always
    slow); when that does not pay, later plans do not see the bursts.

    Args:
        layout: the layout running now.
        known: the health acted on so far in this world.
        verdicts: confirmed fail-slow verdicts (compute, link, recovered).
        hw: the cost model (``live_hardware``).
        quotas: the micro-batch quotas running now.
        horizon_iters: iterations left, over which a change must pay for itself.
        launch_shape: every replica's shape at launch (``replica_shape``): a replica that differs
            was reshaped by an earlier plan, and this one may shape it back.
        rejected: changes rolled back in this world after they did not pay: a plan that would
            make one again keeps the layout instead.
        misjudge: rank -> a false extra slowdown the plan is fed for it (``misjudged``); what the
            detector expects and later plans start from stay true.
        stages_fixed: only quotas may change (``plan_adaptation``'s ``stages_fixed``).
        stages_alike: quotas and one layer split shared by every replica may change
            (``plan_adaptation``'s ``stages_alike``).
        ranks_fixed: quotas and each replica's own layer split may change, its ranks and TP groups
            kept (``plan_adaptation``'s ``ranks_fixed``).
        tp_exclusion: with ``ranks_fixed``, slow ranks may also leave their TP groups, replicas then
            listed in descending TP degree (``plan_adaptation``'s ``tp_exclusion``).
        drop_to: with any of these flags, the replica counts affected replicas may be dropped down to
            (``plan_adaptation``'s ``drop_to``; None: none is dropped).

    Returns:
        A ``FailSlowDecision``.
    """
    calm = known  # between the bursts of a rank slow in bursts
    for verdict in verdicts:
        health = verdict_health(verdict)
        known = known.updated(health)
        if not verdict.intermittent:
            calm = calm.updated(health)
    misjudge = misjudge or {}
    plan = plan_adaptation(layout, misjudged(known, misjudge), hw, current_quotas=tuple(quotas),
                           horizon_iters=horizon_iters, uniform_tp_per_replica=True,
                           reshaped=[r for r, rep in enumerate(layout.replicas) if replica_shape(rep) != launch_shape],
                           stages_fixed=stages_fixed, stages_alike=stages_alike, ranks_fixed=ranks_fixed,
                           tp_exclusion=tp_exclusion, drop_to=drop_to)
    expected = known
    shares = [v.slow_share for v in verdicts if v.intermittent]
    if shares:
        share = max(1.0 if s is None else s for s in shares)
        plan = weigh_bursts(plan, layout, quotas, misjudged(calm, misjudge), misjudged(known, misjudge), share, hw,
                            horizon_iters)
        if plan.action != "adapt":
            known = calm  # bursts not worth planning around: later plans do not see them
    if plan.action == "adapt" and rejected.rejects(layout, quotas, plan.layout, plan.quotas):
        plan = Plan("keep", layout, tuple(quotas), (), plan.iteration_s_before, plan.iteration_s_before, 0.0,
                    "keep: the same change was rolled back before, after it did not pay "
                    f"(predicted {plan.iteration_s_after:.3f} s per iteration)", policy=plan.policy)
    if plan.action == "adapt":
        return FailSlowDecision(plan, known, expected)
    return FailSlowDecision(plan, known, expected,
                            watch_ranks=tuple(r for v in verdicts if v.kind is not VerdictKind.LINK for r in v.ranks),
                            watch_links=tuple(tuple(v.ranks) for v in verdicts if v.kind is VerdictKind.LINK))
