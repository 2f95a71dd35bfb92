"""The measures the fail-slow detector judges, taken from one iteration's op timings.

Responsible for turning ``RankObservation``s into numbers: a per-rank table of op start, end and
busy times, a TP group's op durations, each pipeline link's transfer gap, ratios beyond the
slowdown all their peers share, and the two small containers that remember values over
iterations (ring-buffer baselines, above-threshold streaks).
Judging them is ``resihp_ext.detection.detector``'s job.
"""

from __future__ import annotations

import statistics
import warnings

import numpy as np

from resihp_ext.detection.observation_wire import PackedObservation, packed_op_columns
from resihp_ext.detection.observations import GroupId, LinkId, RankObservation
from resihp_ext.detection.predictor import as_feature_array


def op_tables(observations) -> np.ndarray:
    """Every observation's op table in one array ``[observation, row, micro-batch]``: rows F start,
    F end, B start, B end, F busy, B busy, NaN where not recorded, and past an observation's own
    micro-batches (replicas can run different counts). Start and end place ops on the timeline;
    busy is what the device spent on them.

    Observations as the decider receives them (``PackedObservation``) are read in a few array
    calls for all of them; others op by op (traces, tests): packing them first, to take the array
    path, cost twice the loop (23.2 against 12.5 ms for 1,024 ranks).
    """
    width = max((len(o.features) for o in observations), default=0)
    if not all(isinstance(o, PackedObservation) for o in observations):
        nan = float("nan")
        rows = []
        for obs in observations:
            table = [[nan] * width for _ in range(6)]
            f_start, f_end, b_start, b_end, f_busy, b_busy = table
            for (kind, mb, start, end), busy in zip(obs.ops, obs.op_busy()):
                if kind == "F":
                    f_start[mb], f_end[mb], f_busy[mb] = start, end, busy
                else:
                    b_start[mb], b_end[mb], b_busy[mb] = start, end, busy
            rows.append(table)
        return np.array(rows, dtype=float).reshape(len(observations), 6, width)
    tables = np.full((len(observations), 6, width), np.nan)
    counts, backward, mb, starts, ends, seconds = packed_op_columns(observations)
    owner = np.repeat(np.arange(len(observations)), counts)
    tables[owner, 2 * backward, mb] = starts
    tables[owner, 2 * backward + 1, mb] = ends
    tables[owner, 4 + backward, mb] = seconds
    return tables


class Baselines:
    """Recent healthy values per id in one ring-buffer array, so all medians cost one call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.index: dict = {}
        self.values = np.full((0, size), np.nan)
        self.count = np.zeros(0, dtype=int)

    def __contains__(self, key) -> bool:
        return key in self.index

    def __iter__(self):
        return iter(self.index)

    def medians(self, min_count: int) -> dict:
        if not self.index:
            return {}
        # Full rows in one call; a row still filling holds its values in its first ``count`` slots.
        # (np.nanmedian over the whole array costs ten times as much: it goes through masked arrays.)
        used = len(self.index)
        med = np.full(used, np.nan)
        full = self.count[:used] >= self.size
        if full.any():
            med[full] = np.median(self.values[:used][full], axis=1)
        # Rows still filling, one call per fill level: they fill together (every link of a job
        # reports each iteration), so that is one or two calls, not one per link (1,536 per
        # iteration at 1,024 ranks, most of judging's time there).
        filling = np.flatnonzero(~full & (self.count[:used] >= min_count))
        counts = self.count[filling]
        for count in np.unique(counts):
            rows = filling[counts == count]
            med[rows] = np.median(self.values[rows, :count], axis=1)
        return {k: float(med[i]) for k, i in self.index.items() if self.count[i] >= min_count}

    def quantile(self, key, q: float) -> float:
        """One id's ``q`` quantile of its recent values, interpolated as ``np.quantile`` does (NaN
        before it has any). Sorted in Python: for a few dozen values, a tenth of numpy's cost."""
        i = self.index.get(key)
        if i is None or not self.count[i]:
            return float("nan")
        values = sorted(self.values[i, : min(self.count[i], self.size)].tolist())
        position = q * (len(values) - 1)
        low = int(position)
        if low + 1 >= len(values):
            return values[-1]
        return values[low] + (position - low) * (values[low + 1] - values[low])

    def forget(self, key) -> None:
        """Drop ``key``'s values: it starts over, as if new."""
        i = self.index.get(key)
        if i is not None:
            self.values[i] = np.nan
            self.count[i] = 0

    def add(self, key, value: float) -> None:
        i = self._row(key)
        self.values[i, self.count[i] % self.size] = value
        self.count[i] += 1

    def add_many(self, keys, values) -> None:
        """``add`` each of ``keys`` (distinct) its value, in one array assignment: every link of a
        job reports each iteration, 3,072 calls of ``add`` per iteration at 1,024 ranks."""
        rows = np.array([self._row(key) for key in keys], dtype=int)
        if len(rows):
            self.values[rows, self.count[rows] % self.size] = values
            self.count[rows] += 1

    def _row(self, key) -> int:
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.index)
            if i >= len(self.values):
                grow = max(16, len(self.values))
                self.values = np.vstack([self.values, np.full((grow, self.size), np.nan)])
                self.count = np.concatenate([self.count, np.zeros(grow, dtype=int)])
        return i


class Streak:
    """Suspect iterations of one group or link, with their ratios: a run that survives a few quiet
    iterations between suspect ones.

    A slowdown close to the threshold reads below it now and then: live, a whole TP group 1.4x
    slow read 1.07-1.23x beyond the others in an iteration where they ran 1.1-1.2x slow, and a
    strict run restarted there, so the suspicion came 3 or more iterations late, or never
    (``docs/notes/benchmarks.md`` section 28). Up to ``gap`` quiet iterations in a row keep the run
    going (they add nothing to its count); one more ends it.

    Args:
        gap: quiet iterations in a row a run survives (0: a strict run of consecutive ones).
    """

    __slots__ = ("count", "onset", "ratios", "gap", "quiet")

    # Ratios kept for ``step_onset``; a streak longer than this keeps its latest ones.
    KEPT = 32

    def __init__(self, gap: int = 0) -> None:
        if gap < 0:
            raise ValueError(f"gap must be >= 0, got {gap}")
        self.gap = gap
        self.count = 0
        self.onset = -1
        self.quiet = 0  # quiet iterations since the run's last suspect one
        self.ratios: list[tuple[int, float]] = []

    @property
    def open(self) -> bool:
        """Whether a run is going on (its last suspect iteration at most ``gap`` ago)."""
        return self.count > 0

    def update(self, slow: bool, iteration: int, ratio: float = float("nan")) -> int:
        """Count one judged iteration; returns the run's count if this one is suspect, else 0
        (a suspicion is raised on a suspect iteration only)."""
        if not slow:
            self.quiet += 1
            if self.quiet > self.gap:
                self.count = 0
            return 0
        if self.count == 0:
            self.onset = iteration
            self.ratios = []
        self.count += 1
        self.quiet = 0
        self.ratios.append((iteration, ratio))
        del self.ratios[:-self.KEPT]
        return self.count

    def step_onset(self, step: float, min_after: int) -> int:
        """The iteration the streak stepped up at, else its onset.

        A streak can begin with a milder slowdown than the one it ends in: a busy host or a noisy
        link runs above the threshold for a few iterations, and a fault starts while it is still
        suspect. The step is the earliest iteration from which at least ``min_after`` ratios all
        exceed every earlier ratio of the streak by ``step`` times; the fault started there.
        """
        ratios = [r for _, r in self.ratios]
        if self.count != len(ratios):  # longer than kept, or ratios not given: no earlier level known
            return self.onset
        highest_before = 0.0
        for k in range(1, len(ratios) - min_after + 1):
            highest_before = max(highest_before, ratios[k - 1])
            if min(ratios[k:]) >= step * highest_before:
                return self.ratios[k][0]
        return self.onset


def group_by_stage(observations) -> tuple[dict[GroupId, list[RankObservation]], dict[int, np.ndarray]]:
    """An iteration's observations by stage group ``(replica, stage)``, each group's in TP-rank
    order, and each replica's micro-batch features (every stage of a replica runs the same ones)."""
    groups: dict[GroupId, list[RankObservation]] = {}
    features: dict[int, np.ndarray] = {}
    for obs in observations:
        groups.setdefault((obs.replica, obs.stage), []).append(obs)
        if obs.replica not in features:
            features[obs.replica] = as_feature_array(obs.features)
    for members in groups.values():
        members.sort(key=lambda o: o.tp_rank)
    return groups, features


def nansum(values: np.ndarray) -> float:
    """``np.nansum`` for the common case without NaN at a third of its cost."""
    total = float(values.sum())
    return total if total == total else float(np.nansum(values))


def group_op_durations(rank_times: list[np.ndarray]):
    stacked = np.stack(rank_times)  # [tp, 6, microbatch]
    fwd, bwd = stacked[:, 4], stacked[:, 5]
    # TP siblings meet in every op's all-reduce, so the group runs at its slowest member's
    # pace: the group's busy time is the largest.
    if not (np.isnan(fwd).any() or np.isnan(bwd).any()):
        return fwd.max(axis=0), bwd.max(axis=0)  # common case, much faster
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN column: op not recorded
        return np.nanmax(fwd, axis=0), np.nanmax(bwd, axis=0)


def sibling_ratios(group_busy: dict) -> dict:
    """Per group of two or more TP siblings (group -> each sibling's busy seconds): the slowest
    sibling's busy time over the median of the others'. Siblings run the same ops on the same data,
    so each is the others' reference: one slow rank shows against them whatever the predictor makes
    of the iteration's data."""
    ratios = {}
    for g, busy in group_busy.items():
        if len(busy) > 1:
            busy = sorted(busy)
            others = statistics.median(busy[:-1])
            if others > 0:
                ratios[g] = busy[-1] / others
    return ratios


def wall_per_busy(tables: np.ndarray) -> float:
    """Wall seconds per busy second over every op of every rank (``op_tables``): about 1 when each
    rank has a device of its own, more when ranks share one (CPU cores)."""
    wall = nansum(tables[:, 1] - tables[:, 0]) + nansum(tables[:, 3] - tables[:, 2])
    busy = nansum(tables[:, 4:6])
    return wall / busy if busy > 0 else 1.0


def link_gaps(groups, tables: np.ndarray, row: dict[int, int]) -> dict[LinkId, tuple[float, int]]:
    """Per directed link, (its smallest gap this iteration, how many transfers it made).

    ``tables`` are the ranks' ``op_tables``, ``row`` each rank's index in them. A gap (receiver's
    op start - sender's op end) is an upper bound of the transfer time, as the receiver's op
    starts after its input arrived; the smallest is the tightest. All links in one array
    operation: one per link cost a quarter of judging's time at 1,024 ranks.
    """
    ups, downs = [], []
    for (replica, stage), obs in groups.items():
        below = groups.get((replica, stage + 1))
        if not below:
            continue
        by_tp = {o.tp_rank: o.rank for o in below}
        for o in obs:
            peer = by_tp.get(o.tp_rank)
            if peer is not None:
                ups.append(o.rank)
                downs.append(peer)
    if not ups:
        return {}
    up, down = tables[[row[r] for r in ups]], tables[[row[r] for r in downs]]
    # Per pair, activation gaps (receiver's F start - sender's F end) then gradient gaps (sender's
    # B start - receiver's B end), one row each.
    gap = np.concatenate([down[:, 0] - up[:, 1], up[:, 2] - down[:, 3]])
    counts = np.isfinite(gap).sum(axis=1)
    smallest = np.min(np.where(np.isfinite(gap), gap, np.inf), axis=1)
    links = [*zip(ups, downs), *zip(downs, ups)]
    return {link: (max(float(s), 0.0), int(c)) for link, s, c in zip(links, smallest.tolist(), counts.tolist()) if c}


def beyond_common(ratios: dict, floor: float = 1.0) -> tuple[dict, dict]:
    """Each ratio over what most of the others share: the lower median of their ratios, or
    ``floor`` if that is larger.

    A slowdown most groups or links show is the host's or the job's (a busy host, a job-wide clock
    change), not one device's, and a re-plan that moves work between them gains little. Measured on
    the others only, so one slow subject among healthy ones keeps its whole ratio, and so does each
    of several, while fewer than half of the others are slow too. Why the median and not the
    smallest: a host's slow spell stretches groups unevenly (live, 8 ranks on 2 cores: groups at
    1.34x, 1.13x, 1.10x and 1.01x predicted in one iteration), and the one group it spared would
    set the common slowdown for all the others.

    ``floor`` 1 judges only a common slowdown; 0 also a common speed-up. Stage groups use 0: their
    fits follow a host that runs faster only slowly, and meanwhile the others read 0.8-0.9x
    predicted and a device 1.4x slow only 1.1-1.27x (live, ``docs/notes/benchmarks.md`` section 28);
    against its peers it is still 1.4x. Links keep 1: a link's ratio is to its own recent
    transfers, whose quantiles sit under 1 by noise alone.

    Returns:
        (the ratios beyond the common level, each subject's common level).
    """
    if len(ratios) < 2:
        return dict(ratios), {}
    ordered = sorted(ratios.items(), key=lambda item: item[1])
    values = [r for _, r in ordered]
    middle = (len(values) - 2) // 2  # the lower median's index among the n - 1 others
    common = {k: max(values[middle + 1] if position <= middle else values[middle], floor)
              for position, (k, _) in enumerate(ordered)}
    return {k: r / common[k] for k, r in ratios.items()}, common
