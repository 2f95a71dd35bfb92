"""Each pipeline link's healthy transfer gap, and how far its healthy noise reaches.

Responsible for turning an iteration's link gaps (``resihp_ext.detection.op_signals.link_gaps``) into
ratios against each link's recent healthy median, and for learning from the iteration after it
was judged. A gap counts as slow only when it also exceeds the link's noise reach, the 95th
percentile of its recent readings that did not persist: the healthy ones, and every reading
above the threshold that the next iteration did not repeat. Why: on a host whose cores are all
taken, a receiver now and then wakes a few milliseconds late; its link's smallest gap of the
iteration then reads 2-10x the sub-millisecond median, in about one iteration in four, and two
such readings in a row (a suspicion, under a median-only baseline) came every few dozen
iterations per link. A persistent slowdown never enters the noise it is judged against.
"""

from __future__ import annotations

from resihp_ext.detection.observations import LinkId
from resihp_ext.detection.op_signals import Baselines

# Share of a link's non-persistent readings its noise reach stays above: noise the link shows again
# and again (about one reading in four, on a busy CPU host) stops counting, while a lone outlier
# (one 50 ms pause in the history) does not hide a real slowdown behind it.
NOISE_QUANTILE = 0.95


class LinkBaselines:
    """Per directed link: recent healthy gaps (their median is the baseline) and recent
    non-persistent readings (their 95th percentile is the noise reach).

    Args:
        size: readings remembered per link.
        min_count: readings a link needs before it is judged.
    """

    def __init__(self, size: int, min_count: int = 3) -> None:
        self.min_count = min_count
        self._healthy = Baselines(size)
        self._noise = Baselines(size)
        self._run_start: dict[LinkId, float | None] = {}  # first reading of a run above threshold
        self.base: dict[LinkId, float] = {}

    def __iter__(self):
        return iter(self._healthy)

    def ratios(self, gaps, min_excess_s: float, judge: bool = True) -> dict[LinkId, float]:
        """Each judged link's gap over its baseline; at most 1 unless the gap exceeds the link's
        noise reach by ``min_excess_s`` summed over the iteration's transfers. Without ``judge``
        (links are not judged this iteration) none, but ``base`` is brought up to date."""
        self.base = self._healthy.medians(self.min_count)
        out: dict[LinkId, float] = {}
        if not judge:
            return out
        for link, (gap, transfers) in gaps.items():
            base = self.base.get(link)
            if base is None:
                continue
            ratio = gap / max(base, 1e-9)
            slow = (gap - base) * transfers > min_excess_s
            if slow:  # rarely: the noise reach is worked out only then
                slow = (gap - max(self._noise.quantile(link, NOISE_QUANTILE), base)) * transfers > min_excess_s
            out[link] = ratio if slow else min(ratio, 1.0)
        return out

    def forget(self, link: LinkId) -> None:
        """Start ``link`` over: its next ``min_count`` readings, whatever they are, are its new norm."""
        self._healthy.forget(link)
        self._noise.forget(link)
        self._run_start.pop(link, None)
        self.base.pop(link, None)

    def learn(self, gaps, ratios: dict, threshold: float, muted) -> None:
        """Remember this iteration's readings: those at or below ``threshold`` as healthy (unless
        the link is ``muted``: a known slowdown); the first of a run above it as noise once the
        next reading is back below, so only a slowdown that persisted is left out."""
        links, healthy, spikes = [], [], []
        for link, (gap, _) in gaps.items():
            if ratios.get(link, 1.0) > threshold:
                self._run_start[link] = gap if link not in self._run_start else None
                continue
            spike = self._run_start.pop(link, None)
            if link in muted:
                continue
            links.append(link)
            healthy.append(gap)
            if spike is not None:
                spikes.append((link, spike))
        self._healthy.add_many(links, healthy)
        self._noise.add_many(links, healthy)
        for link, spike in spikes:  # after the link's healthy reading, as it came
            self._noise.add(link, spike)
