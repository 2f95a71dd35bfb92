"""What the running plan priced each stage group's compute at, as the judge of groups that have no
cost model of their own yet.

Responsible for ``planned_ratios``: each group's compute over the planner's price for the
micro-batches it ran, beyond what the other groups ran against theirs. Why it exists: after a
re-plan every cost model starts over, and a group whose stage shape no other group runs learns its
model from itself alone. A device slow since the re-plan then teaches that model its slowness as
the norm, and without TP siblings to show it against, it was never found. The planner's price is
coarse (per-layer costs at TP 1, measured on the healthiest stage), so a group is judged on it only
beside the others: a bias the price shares with every group divides out, as a host's slow spell
does.
"""

from __future__ import annotations

from collections.abc import Mapping

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
