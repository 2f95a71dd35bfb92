"""What the running plan priced each stage group's compute at, as the judge of groups that have no
cost model of their own yet.

Responsible for ``PlanPrice``: the price of each group under the plan now running, which groups
probes have vouched for since, and each group's compute over its price beyond what the other
groups ran against theirs (``planned_ratios``). Why it exists: cost models are per stage shape,
and after a re-plan a group whose shape no other group runs learns its model from itself alone. A
device slow since the re-plan then teaches that model its slowness as the norm, and without TP
siblings to show it against, it was never found. The planner's price is coarse (per-layer costs at
TP 1, measured on the healthiest stage), so a group is judged on it only beside the others: a bias
the price shares with every group divides out, as a host's slow spell does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence

from resihp_ext.detection.observations import GroupId
from resihp_ext.detection.op_signals import beyond_common


def planned_ratios(observed_s: Mapping[GroupId, float], microbatches: Mapping[GroupId, int],
                   planned_s: Mapping[GroupId, float]) -> tuple[dict[GroupId, float], dict[GroupId, float]]:
    """Each group's compute against its price, over the lower median of the others' (``beyond_common``).

    Args:
        observed_s: each group's compute seconds in the iteration (forwards and backwards).
        microbatches: micro-batches each group ran.
        planned_s: the plan's price of one micro-batch's forward and backward, per group.

    Returns:
        (the ratios beyond the common level, each group's common level), for the groups that ran
        at least one micro-batch and have a price.
    """
    plain = {g: seconds / (planned_s[g] * microbatches[g]) for g, seconds in observed_s.items()
             if planned_s.get(g, 0.0) > 0.0 and microbatches.get(g, 0) > 0 and seconds > 0.0}
    return beyond_common(plain, floor=0.0)


class PlanPrice:
    """The running plan's price per group, and which groups it judges.

    A group is judged on it when only its own data could teach its cost model (one rank, a stage
    shape no other group runs), while that model is not fitted, its slowdown is not known already
    (its device was probed when it was named), and probes have not vouched for it since the plan
    began (``vouch``: a group they clear learns from then on).
    """

    def __init__(self) -> None:
        self.microbatch_s: dict[GroupId, float] = {}
        self.common: dict[GroupId, float] = {}  # each judged group's common level, as last read
        self._vouched: set[GroupId] = set()

    def price(self, microbatch_s: Mapping[GroupId, float]) -> None:
        """A new plan's price (``(replica, stage)`` -> seconds of one micro-batch's forward and
        backward at a healthy device's speed); nothing is vouched for under it yet."""
        self.microbatch_s = {tuple(g): float(s) for g, s in microbatch_s.items()}
        self._vouched = set()

    def vouch(self, group: GroupId) -> None:
        """Probes found ``group``'s devices as fast as their peers': its own data may teach it."""
        self._vouched.add(group)

    def ratios(self, observed_s: Mapping[GroupId, float], microbatches: Mapping[GroupId, int],
               members: Mapping[GroupId, Sequence], shapes: Mapping[GroupId, Hashable],
               fitted: Mapping[GroupId, bool], known: Collection[GroupId]) -> dict[GroupId, float]:
        """The groups judged on the price this iteration, each with its ratio beyond the others'.

        Args:
            observed_s, microbatches: each group's compute seconds and micro-batches (``planned_ratios``).
            members: each group's ranks (or their observations); shapes: each group's cost-model
                key; fitted: whether that model is fitted; known: the groups holding a known slow rank.
        """
        ratios, self.common = planned_ratios(observed_s, microbatches, self.microbatch_s)
        running = Counter(shapes.values())
        return {g: r for g, r in ratios.items()
                if not fitted[g] and g not in self._vouched and g not in known
                and len(members[g]) == 1 and running[shapes[g]] == 1}
