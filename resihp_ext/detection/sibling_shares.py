"""Each TP rank's usual share of its group's busy time, learnt from healthy iterations.

Responsible for the sibling signal: a group's slowest TP rank's busy time over the median of its
siblings', each first divided by its usual share of the group's work. Siblings run the same ops on
the same data, yet not always for the same time: live on CPU (TP2 x PP2 x DP2, gloo), TP rank 0 of
every group ran about 10% busier than TP rank 1 (0-30% in single iterations), so a 1.5x slow TP
rank 1 read 1.20-1.35x against its sibling in most iterations, and a 1.25 threshold missed some of
them (the suspicion came a streak late). Dividing by the learnt share removes such a standing offset.

A share is learnt only from the iterations the detector found healthy for the group (a suspect
group teaches nothing), and is held within ``MAX_OFFSET`` of 1: a slowdown that creeps in below
the threshold can be taken for the norm only that far.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping

from resihp_ext.detection.observations import GroupId
from resihp_ext.detection.op_signals import sibling_ratios

# The largest standing offset learnt between siblings (a share within 1 -+ this).
MAX_OFFSET = 0.15
# Healthy iterations a share needs before it is used; until then a rank's share is 1.
MIN_SAMPLES = 3


class SiblingShares:
    """The learnt shares of every TP rank of every group with two or more.

    Args:
        history: healthy iterations remembered per rank (the share is their median).
    """

    def __init__(self, history: int) -> None:
        self.history = history
        # (the group's ranks, rank) -> its recent shares; the group's ranks are part of the key, so
        # a rank re-grouped by a re-plan learns its share among its new siblings afresh.
        self._shares: dict[tuple[tuple[int, ...], int], deque] = defaultdict(lambda: deque(maxlen=history))

    def share(self, ranks: tuple[int, ...], rank: int) -> float:
        """``rank``'s usual busy time over its group's median (1 until learnt)."""
        recent = self._shares.get((ranks, rank))
        if recent is None or len(recent) < MIN_SAMPLES:
            return 1.0
        return min(max(statistics.median(recent), 1.0 - MAX_OFFSET), 1.0 + MAX_OFFSET)

    def ratios(self, group_busy: Mapping[GroupId, Mapping[int, float]]) -> dict[GroupId, float]:
        """Per group of two or more siblings (group -> rank -> busy seconds): the slowest sibling's
        busy time over the median of the others', each divided by its share
        (``op_signals.sibling_ratios``)."""
        normalized = {}
        for g, busy in group_busy.items():
            ranks = tuple(sorted(busy))
            normalized[g] = [busy[r] / self.share(ranks, r) for r in ranks]
        return sibling_ratios(normalized)

    def learn(self, group_busy: Mapping[GroupId, Mapping[int, float]], healthy: Iterable[GroupId]) -> None:
        """Remember each sibling's share in the ``healthy`` groups of this iteration."""
        for g in healthy:
            busy = group_busy.get(g, {})
            if len(busy) < 2:
                continue
            middle = statistics.median(busy.values())
            if middle <= 0:
                continue
            ranks = tuple(sorted(busy))
            for r in ranks:
                self._shares[(ranks, r)].append(busy[r] / middle)
