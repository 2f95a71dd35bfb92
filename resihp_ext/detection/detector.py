"""Fail-slow decisions over plain per-iteration observations.

Responsible for judging, once per iteration, whether any pipeline-stage group (the TP ranks of one
stage of one DP replica) or any pipeline link runs persistently slower than the time predicted
*for the data it actually processed*, and for turning validation-probe results into a Verdict or
a Cleared. Because the predictor follows sequence packing (``T = alpha*N + beta*sum l_i^2``), an
iteration that is slow because its documents were long is not suspect; one that is slow for the
same data is.

Decisions:
    * per group: ratio = observed compute seconds / predicted seconds for its micro-batches
      (median over the group's TP ranks; TP siblings wait for each other inside collectives, so a
      slow rank stretches all of them and only probes can tell which one it is);
    * per group of TP siblings, whatever the prediction: its slowest rank's busy time over the
      others', each over its usual share of the group's work (``resihp_ext.detection.sibling_shares``);
    * per directed link: ratio = observed transfer gap / its healthy baseline, the gap being the
      smallest delay between a sender's op end and the receiver's op start over the iteration's
      micro-batches (the receiver waited at least once, so the minimum is the transfer itself),
      counted only when its excess beyond the link's recent noise is a noticeable part of the
      iteration (``resihp_ext.detection.link_baselines``);
    * a slowdown most groups (or most links) show is the host's or the job's, not a device's:
      each ratio is judged over the lower median of the others' (a link's when above 1, a
      group's either way: a group is judged against its peers) (``op_signals.beyond_common``);
    * a run of ``persistence_iters`` judged iterations with a ratio above ``slowdown_threshold``
      becomes a Suspicion (a single noisy iteration triggers nothing); while ranks share devices,
      of ``shared_host_persistence_iters``. A run survives ``persistence_gap_iters`` quiet
      iterations in a row (``op_signals.Streak``), and its group is not learnt from meanwhile;
    * ``conclude`` localises with the probes (``resihp_ext.detection.validation``) and returns the Verdict
      or Cleared the round supports (``resihp_ext.detection.probe_verdicts``).

The values a suspicion concludes to (``Verdict``, ``Cleared``) and the fail-stop judgement
(``judge_heartbeats``, ``fail_stop_verdict``) live in ``resihp_ext.detection.validation`` and are
re-exported here, so callers import the whole detection API from this module.

It must never read clocks, files or process groups, nor time anything: the live loop passes
observations, ``now`` and probe timings in, and acts on what comes back.
"""

from __future__ import annotations

import functools
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.observations import (  # noqa: F401  (part of this module's API)
    DetectorReport,
    GroupId,
    LinkId,
    OpRecord,
    RankObservation,
    Suspicion,
)
from resihp_ext.detection.healthy_learning import learn_from_healthy
from resihp_ext.detection.link_baselines import LinkBaselines
from resihp_ext.detection.op_signals import (Streak, beyond_common, group_by_stage, group_op_durations, link_gaps, nansum,
                                            op_tables, wall_per_busy)
from resihp_ext.detection import probe_verdicts
from resihp_ext.detection.iteration_estimate import IterationEstimate
from resihp_ext.detection.planned_costs import PlanPrice
from resihp_ext.detection.predictor import MicrobatchPredictor
from resihp_ext.detection.sibling_shares import SiblingShares
from resihp_ext.detection.speed_level import SpeedLevels
from resihp_ext.schedule import Interleaving
from resihp_ext.detection.suspicions import (
    bursts_ended_suspicion,
    compute_suspicion,
    link_suspicion,
    recovery_suspicion,
    reference_links,
    reference_ranks,
)
from resihp_ext.detection.validation import (  # noqa: F401  (Verdict values are part of this API)
    Cleared,
    ProbeResults,
    Verdict,
    fail_stop_verdict,
    judge_heartbeats,
)

# A link is only suspect when its transfer also grew by this many seconds in absolute terms, so a
# sub-millisecond baseline jittering by a few microseconds never looks like a 2x slowdown.
_MIN_LINK_EXCESS_S = 1e-3
_MIN_LINK_EXCESS_FRACTION = 0.01  # of the iteration time, summed over the link's transfers
# Wall seconds per busy second of ops above which ranks share devices (CPU cores): a transfer's
# gap then measures the OS scheduler more than the link, and links are not judged; a compute
# slowdown must persist for ``shared_host_persistence_iters``.
_SHARED_DEVICE_CONTENTION = 1.5
# Healthy iterations remembered for link baselines and for the iteration overhead estimate.
_HISTORY = 32
# Judged iterations per group remembered for ``slow_share`` (beyond any --resihp-intermittent-window-iters in use).
_SLOW_MARKS = 1024
# Healthy links probed beside a suspected one, so the probe round has its own reference.
_LINK_REFERENCES = 3


class FailSlowDetector:
    """Judges iterations, raises Suspicions, and concludes them from probe results.

    Args:
        config: thresholds (``slowdown_threshold``, ``persistence_iters``, ``warmup_iters``,
            ``probe_threshold``, ``cleared_cooldown_iters``); defaults if None.
        predictor: micro-batch predictor to use (a fresh one if None).
        stage_signature: ``(replica, stage, tp_degree) -> hashable`` naming the stage
            configuration whose cost model a group uses; default ``(stage, tp_degree)``, so
            replicas with the same configuration share (and cross-check) one fit.
        interleaving: the replicas' pipeline schedule. Under the interleaved one an observation's
            ops and features come one per model chunk's op (``Interleaving``): groups and links
            are judged op by op as under 1F1B (a column is the same micro-batch and chunk on every
            stage, so a link's gaps stay within a chunk; the wrap from the last stage to the first
            is not judged), and the iteration is predicted by walking the interleaved schedule.
    """

    def __init__(
        self,
        config: ResiHPConfig | None = None,
        predictor: MicrobatchPredictor | None = None,
        stage_signature: Callable[[int, int, int], Hashable] | None = None,
        interleaving: Interleaving = Interleaving(),
    ) -> None:
        self.config = config or ResiHPConfig()
        self.interleaving = interleaving
        self.predictor = predictor or MicrobatchPredictor()
        self._signature = stage_signature or (lambda replica, stage, tp: (stage, tp))
        self.last_report: DetectorReport | None = None
        self._expected: dict[int, float] = {}
        self._in_bursts: dict[int, float] = {}
        self._probe_baselines: dict[int, float] = {}
        self.levels = SpeedLevels(self.config.speed_level_halflife_iters, self.config.max_speed_drift)
        self.reset()

    def expect(self, slow_factors, bursts=()) -> None:
        """Slowdowns already acted on (rank -> factor, e.g. 3.0): the op times of a group holding
        such a rank are divided by its largest factor before anything is judged or learnt, so a
        known slow device is the norm (one shared fit for the stage, no second verdict for it)
        and only a further change alarms. Replaces what an earlier call said; kept across
        ``reset``.

        The ranks in ``bursts`` are slow only in bursts (``resihp_ext.detection.recurrence``), at full speed
        between them, so dividing their group's times would make every calm iteration look like a
        recovery and teach the cost model half the real speed. Their group is judged as it runs,
        against a threshold raised by its factor: only bursts worse than the known ones alarm. It
        is learnt from in the calm only, and never probed as a reference or suspected of recovery.
        """
        bursts = {int(r) for r in bursts}
        factors = {int(r): float(f) for r, f in slow_factors.items() if f > 1.0}
        self._expected = {r: f for r, f in factors.items() if r not in bursts}
        self._in_bursts = {r: f for r, f in factors.items() if r in bursts}

    @property
    def known_slowdowns(self) -> dict[int, float]:
        """The steady slowdowns ``expect`` was told of (rank -> factor), whose groups' times are
        divided by them."""
        return dict(self._expected)

    def plan(self, microbatch_s: Mapping[GroupId, float]) -> None:
        """What the plan now running priced each stage group's compute at (``(replica, stage)`` ->
        seconds of one micro-batch's forward and backward, at the device's healthy speed): until a
        group's own cost model is fitted, it is judged against this price beside the other groups
        (``planned_costs``), and not learnt from while it runs slow against it. ``reset`` forgets it."""
        self._price.price(microbatch_s)

    def needs_probe_baselines(self, groups: Sequence[Sequence[int]]) -> bool:
        """Whether a suspicion among ``groups`` (each a stage group's ranks) could find no healthy
        group to probe beside it, so the probes need each rank's own healthy probe time."""
        return len(groups) < 2

    def set_probe_baselines(self, rank_s) -> None:
        """Each rank's GEMM probe seconds while healthy (rank -> seconds), measured before any
        fault. A probe round with no healthy peer (every probed rank a suspect) compares each rank
        with its own; kept across ``reset``, since a re-plan does not change a device's speed."""
        self._probe_baselines = {int(r): float(s) for r, s in rank_s.items() if s > 0}

    def reset(self, forget_predictor: bool = True) -> None:
        """Start over after a re-plan: new groups, new costs, warm-up again."""
        if forget_predictor:
            self.predictor.reset()
        self.levels.reset()  # groups are renamed by a re-plan; each learns its level again
        self._seen = 0
        new_streak = functools.partial(Streak, self.config.persistence_gap_iters)
        self._group_streak: dict[GroupId, Streak] = defaultdict(new_streak)
        self._recovery_streak: dict[GroupId, Streak] = defaultdict(new_streak)
        self._known_groups: dict[GroupId, float] = {}
        self._burst_groups: dict[GroupId, float] = {}
        # A bursting group's first iteration without a burst, and its current run of slow iterations.
        self._calm: dict[GroupId, tuple[int, int]] = {}
        self._link_streak: dict[LinkId, Streak] = defaultdict(new_streak)
        self._links = LinkBaselines(_HISTORY)
        self._iteration = IterationEstimate(_HISTORY)
        self._sibling_shares = SiblingShares(_HISTORY)
        self._shared = False  # ranks share devices (judged on the contention history)
        self._pending: set = set()
        self._muted: set = set()
        self._cooldown: dict = {}
        self._stage_common: dict[GroupId, float] = {}
        self._price = PlanPrice()
        self._link_common: dict[LinkId, float] = {}
        self._group_ranks: dict[GroupId, tuple[int, ...]] = {}
        self._rank_group: dict[int, GroupId] = {}
        # Per group, (iteration, judged slow) for recent judged iterations: how much of the time it is slow.
        self._slow_marks: dict[GroupId, deque] = defaultdict(lambda: deque(maxlen=_SLOW_MARKS))

    # ---------------------------------------------------------------- per-iteration judgement

    def observe(self, iteration: int, observations: Sequence[RankObservation],
                tables: np.ndarray | None = None) -> Suspicion | None:
        """Judge one iteration; learn from what looks healthy.

        Args:
            iteration: the training iteration these observations belong to.
            observations: one ``RankObservation`` per rank that reported.
            tables: ``op_tables(observations)``, when the caller built them (it shares them with
                ``fit_compute_costs``).

        Returns:
            A new Suspicion (the caller should run the probes it names and call ``conclude``),
            or None.
        """
        if not observations:
            return None
        groups, feats = self._group(observations)
        if tables is None:
            tables = op_tables(observations)
        row = {o.rank: i for i, o in enumerate(observations)}
        times = {o.rank: tables[i, :, :len(o.features)] for i, o in enumerate(observations)}
        durations = {g: group_op_durations([times[o.rank] for o in obs]) for g, obs in groups.items()}
        # A group runs at its slowest member's pace, so a known slowdown scales the whole group.
        known = self._group_factors(self._expected, durations)
        for g, factor in known.items():
            fwd, bwd = durations[g]
            durations[g] = (fwd / factor, bwd / factor)
        self._known_groups = known
        self._burst_groups = {g: f for g, f in self._group_factors(self._in_bursts, durations).items()
                              if g not in known}
        keys = {g: self.keys_for(*g, len(obs)) for g, obs in groups.items()}
        fitted = all(self.predictor.fitted(k) for ks in keys.values() for k in ks)
        warm = self._seen >= self.config.warmup_iters
        self._seen += 1

        stage_ratio: dict[GroupId, float] = {}
        rank_ratio: dict[int, float] = {}
        rank_busy = dict(zip(row, np.nansum(tables[:, 4:6], axis=(1, 2)).tolist()))
        # Siblings of a known slow rank wait for it on a device and not on a CPU, so against them
        # it tells nothing: the prediction alone judges such a group.
        sibling_busy = {g: {o.rank: rank_busy[o.rank] for o in obs} for g, obs in groups.items()
                        if g not in known and g not in self._burst_groups}
        sibling_ratio = self._sibling_shares.ratios(sibling_busy)
        # Per group, each op's predicted seconds: the model times the group's speed level.
        op_predicted = {g: self.predictor.predict_ops(keys[g], feats[g[0]], self.levels.level(g)) for g in groups}
        # Each group whose cost model is fitted is judged on it: a group slow since a re-plan, in
        # a stage shape no other group has, never teaches its own model, and must not leave every
        # other group unjudged (its TP siblings, where it has any, show it meanwhile).
        for g, (fwd, bwd) in durations.items():
            if op_predicted[g] is None:
                continue
            predicted = float(sum(p.sum() for p in op_predicted[g]))
            if predicted <= 0:
                continue
            stage_ratio[g] = (nansum(fwd) + nansum(bwd)) / predicted
            for o in groups[g]:
                rank_ratio[o.rank] = rank_busy[o.rank] / predicted
        planned_ratio = {}
        if self._price.microbatch_s:  # a plan was priced: after a re-plan or a re-form
            observed = {g: float(nansum(fwd) + nansum(bwd)) for g, (fwd, bwd) in durations.items()
                        if g not in self._burst_groups}
            planned_ratio = self._price.ratios(
                observed, {g: self.interleaving.microbatches(len(feats[g[0]])) for g in observed}, groups,
                keys, {g: op_predicted[g] is not None for g in groups}, known)
        contention = wall_per_busy(tables)
        gaps = link_gaps(groups, tables, row)
        observed_iter = statistics.median(o.iteration_s for o in observations)
        # A link is only suspect when its excess, over all its transfers in the iteration, matters
        # to the iteration (``LinkBaselines.ratios``): a sub-millisecond baseline jittering by a
        # few microseconds, or a receiver that now and then wakes late, is not a 2x slowdown.
        min_excess_s = max(_MIN_LINK_EXCESS_S, _MIN_LINK_EXCESS_FRACTION * observed_iter)
        self._shared = self._iteration.typical_contention(contention) >= _SHARED_DEVICE_CONTENTION
        link_ratio = self._links.ratios(gaps, min_excess_s, judge=not self._shared)
        predicted_iter = None
        if fitted:
            predicted_iter = self._iteration.predict(self.predictor, keys, feats, self.levels.level, self._transfer_s,
                                                     observed_iter, contention, self.config.slowdown_threshold,
                                                     self.interleaving)
        self.last_report = DetectorReport(
            iteration, warm, stage_ratio, rank_ratio, link_ratio, predicted_iter, observed_iter, sibling_ratio,
            planned_ratio
        )

        threshold = self.config.slowdown_threshold
        slow_stage, self._stage_common = beyond_common(stage_ratio, floor=0.0)
        slow_link, self._link_common = beyond_common(link_ratio)
        suspicion = None
        if warm:
            suspicion = self._decide(iteration, slow_stage, sibling_ratio, slow_link, stage_ratio, planned_ratio)
        # Learn only from what is not suspect, so a persistent slowdown never becomes the norm: not
        # from a group whose run of suspect iterations is still open either (a slowdown near the
        # threshold reads under it now and then); never from the first iteration after a (re)start,
        # which pays one-off set-up costs.
        healthy = [g for g in durations
                   if not (self._seen == 1 or g in self._muted or g in self._pending
                           or stage_ratio.get(g, 1.0) > threshold or self._group_streak[g].open
                           or sibling_ratio.get(g, 1.0) > threshold or planned_ratio.get(g, 1.0) > threshold
                           or (g in known and stage_ratio.get(g, 1.0) * threshold < 1.0))]  # faster than known: not the norm
        learn_from_healthy(self.predictor, self.levels, healthy, durations, keys, feats, op_predicted)
        self._sibling_shares.learn(sibling_busy, healthy)
        self._links.learn(gaps, link_ratio, threshold, self._muted)
        return suspicion

    def _decide(self, iteration, slow_stage, sibling_ratio, slow_link, stage_ratio, planned_ratio) -> Suspicion | None:
        """Update the streaks and return the worst subject that is ready to probe, if any.

        ``slow_stage`` and ``slow_link`` are the ratios beyond the common slowdown (slowness is
        judged on them); ``stage_ratio`` is the plain one: a recovery is judged on it, since a
        slowdown elsewhere must not make a known slow group look fast, over the common level only
        where that is a speed-up. ``planned_ratio`` judges the groups with no fitted model yet.
        """
        threshold, need = self.config.slowdown_threshold, self._persistence()
        ready = []
        for g in slow_stage.keys() | sibling_ratio.keys() | planned_ratio.keys():
            ratio, signal = max((slow_stage.get(g, 0.0), "predicted"), (sibling_ratio.get(g, 0.0), "siblings"),
                                (planned_ratio.get(g, 0.0), "planned"))
            # A group known to be slow in bursts alarms only beyond its known bursts.
            count = self._group_streak[g].update(ratio > threshold * self._burst_groups.get(g, 1.0), iteration, ratio)
            self._slow_marks[g].append((iteration, ratio > threshold))
            if count >= need and self._eligible(g, iteration):
                ready.append((ratio, "compute", g, signal))
            if g in self._burst_groups and self._bursts_ended(g, iteration, ratio > threshold):
                ready.append((1.0, "bursts ended", g, None))
        for link, ratio in slow_link.items():
            count = self._link_streak[link].update(ratio > threshold, iteration, ratio)
            if count >= need and self._eligible(link, iteration):
                ready.append((ratio, "link", link, None))
        for g in () if self.config.no_recovery else self._known_groups:
            # A group with a known slow rank that runs faster than that slowdown predicts: the
            # device may have recovered, and its work can go back to it. Judged against its peers
            # when they all run faster than the model (a host in a fast spell speeds the known
            # group too, and would make it look recovered), else on its own ratio.
            ratio = stage_ratio.get(g)
            if ratio is None:
                continue
            ratio /= min(1.0, self._stage_common.get(g, 1.0)) or 1.0
            count = self._recovery_streak[g].update(ratio * threshold < 1.0, iteration)
            if count >= need and self._eligible(("recovery", g), iteration):
                ready.append((1.0 / max(ratio, 1e-9), "recovery", g, None))
        if not ready:
            return None
        # Compute first: a slow stage also delays what it sends; among equals, the worst ratio.
        ratio, kind, what, signal = max(ready, key=lambda item: (item[1] == "compute", item[0]))
        if kind == "compute":
            suspicion = self._compute_suspicion(iteration, what, ratio, signal)
        elif kind == "recovery":
            suspicion = self._recovery_suspicion(iteration, what, ratio)
        elif kind == "bursts ended":
            reference = self._reference_ranks(what, also_avoid=self._known_groups)
            suspicion = bursts_ended_suspicion(iteration, what, self._group_ranks[what], self._in_bursts, reference,
                                               self._calm[what][0])
        else:
            suspicion = self._link_suspicion(iteration, what, ratio)
        self._pending.add(self._subject(suspicion))
        return suspicion

    def _bursts_ended(self, g: GroupId, iteration: int, slow: bool) -> bool:
        """Whether group ``g``, known to be slow in bursts, has now run a whole
        ``intermittent_window_iters`` without one. Its bursts came at least
        ``intermittent_episodes`` times within such a window when it was named, so a window
        without any says they have stopped, and the probes can tell whether it is fast.

        A burst is a run of slow iterations as long as a suspicion needs: a lone noisy iteration
        is not one (live, on a shared host, one came every few dozen iterations and a calm that
        any slow iteration ended never lasted a window)."""
        since, run = self._calm.get(g, (iteration, 0))
        run = run + 1 if slow else 0
        if run >= self._persistence():
            since = iteration + 1
        self._calm[g] = (since, run)
        return (not slow and not self.config.no_recovery
                and iteration - since + 1 >= self.config.intermittent_window_iters
                and self._eligible(("recovery", g), iteration))

    def _persistence(self) -> int:
        """Consecutive suspect iterations a suspicion needs. Ranks that share cores see the host's
        slow spells in their busy time too, and such a spell can single out one group for two
        iterations: replayed over 3,450 healthy iterations of 8 ranks on 2 cores, 2 in a row made
        4 suspicions and 3 in a row none (``docs/notes/benchmarks.md`` section 26)."""
        need = self.config.persistence_iters
        return max(need, self.config.shared_host_persistence_iters) if self._shared else need

    def _eligible(self, what, iteration: int) -> bool:
        if what in self._pending or what in self._muted:
            return False
        return iteration >= self._cooldown.get(what, -1)

    def _compute_suspicion(self, iteration: int, g: GroupId, ratio: float, signal: str) -> Suspicion:
        common = (self._price.common if signal == "planned" else self._stage_common).get(g, 1.0)
        return compute_suspicion(iteration, g, self._group_ranks[g], self._reference_ranks(g), self._group_streak[g],
                                 ratio, signal, common, self.config.slowdown_threshold)

    def _reference_ranks(self, g: GroupId, also_avoid=()) -> tuple[int, ...]:
        running_slow = {h: streak.ratios[-1][1] if streak.ratios else 0.0
                        for h, streak in self._group_streak.items() if streak.open}
        return reference_ranks(g, self._group_ranks, avoid={*self._muted, *self._burst_groups, *also_avoid},
                               last_resort=(running_slow, self._pending, self._known_groups), slowness=running_slow)

    def _recovery_suspicion(self, iteration: int, g: GroupId, speedup: float) -> Suspicion:
        reference = self._reference_ranks(g, also_avoid=self._known_groups)
        return recovery_suspicion(iteration, g, self._group_ranks[g], self._expected, reference,
                                  self._recovery_streak[g], speedup)

    def _link_suspicion(self, iteration: int, link: LinkId, ratio: float) -> Suspicion:
        references = reference_links(link, self._links, self._rank_group, _LINK_REFERENCES)
        return link_suspicion(iteration, link, self._rank_group[link[0]], self._rank_group[link[1]], references,
                              self._link_streak[link], ratio, self._link_common.get(link, 1.0))

    # ---------------------------------------------------------------- validation

    def release(self, suspicion: Suspicion, iteration: int) -> None:
        """Drop a suspicion (its probes, or a second round of them, named nobody): unmute its
        group or link, cool it down, and start its persistence count over."""
        what = self._subject(suspicion)
        self._pending.discard(what)
        self._muted.discard(what)
        self._cooldown[what] = iteration + self.config.cleared_cooldown_iters
        # The cost model is not relearned here: a real fault starting during the cooldown would be
        # learned as normal.
        streaks = {"compute": self._group_streak, "link": self._link_streak, "recovery": self._recovery_streak}
        group = (suspicion.replica, suspicion.stage)
        # A bursting group's calm stands: probes that caught it slow ended it only if a burst has
        # begun, and then the burst's slow run ends it; after noisy probes it is asked again.
        streaks[suspicion.kind].pop(suspicion.links[0] if suspicion.kind == "link" else group, None)
        if suspicion.kind == "compute":
            self._price.vouch(group)

    def slow_share(self, group: GroupId, first: int, last: int) -> float | None:
        """The share of ``group``'s judged iterations ``first..last`` in which it ran slow (above
        ``slowdown_threshold``), or None when none was judged. How much of the time a device slow
        in bursts costs the job."""
        marks = [slow for iteration, slow in self._slow_marks.get(group, ()) if first <= iteration <= last]
        return sum(marks) / len(marks) if marks else None

    def watch_again(self, ranks, links=()) -> None:
        """Judge again the groups holding ``ranks`` and the ``links`` (``(src, dst)``), which their
        verdicts muted, from a fresh run of suspect iterations. For a plan that kept the layout:
        the groups' slowdowns are expected now (``expect``), so only a further change (slower
        still, or fast again) alarms. A link has no expected factor: it learns its baseline
        afresh, at its slow speed, so only a further slowdown alarms (one that ends does not)."""
        for group in {self._rank_group[r] for r in ranks if r in self._rank_group}:
            self._muted.difference_update((group, ("recovery", group)))
            self._group_streak.pop(group, None)
        for link in links:
            link = tuple(link)
            self._muted.discard(link)
            self._link_streak.pop(link, None)
            self._links.forget(link)

    def mute(self, suspicion: Suspicion) -> None:
        """Judge a suspicion's group (link) no more until ``reset``: a verdict stands for it, as one
        from its probes does. For verdicts reached other than by ``conclude``."""
        self._muted.add(self._subject(suspicion))

    @staticmethod
    def _subject(suspicion: Suspicion):
        """What a suspicion is about, as the pending, muted and cooldown sets name it."""
        if suspicion.kind == "link":
            return suspicion.links[0]
        group = (suspicion.replica, suspicion.stage)
        return ("recovery", group) if suspicion.kind == "recovery" else group

    def conclude(self, suspicion: Suspicion, probes: ProbeResults) -> Verdict | Cleared:
        """Turn a Suspicion and its probe timings into a Verdict or a Cleared.

        Args:
            suspicion: what ``observe`` returned.
            probes: timings of the probes ``suspicion.probe_ranks``/``probe_links`` ran.

        Returns:
            A Verdict naming slow ranks or link with the probe factor, or Cleared.
        """
        what = self._subject(suspicion)
        self._pending.discard(what)
        outcome = probe_verdicts.read_round(suspicion, probes, self._onset(suspicion), self.config.probe_threshold,
                                            self._probe_baselines, self._expected, self._in_bursts)
        if isinstance(outcome, Verdict):
            self._muted.add(what)
        else:
            self.release(suspicion, probes.iteration)
        return outcome

    def _onset(self, suspicion: Suspicion) -> int:
        """When the slowdown behind ``suspicion`` began, as far as its streak can tell by now.

        A suspicion's onset is where its streak began, and the streak can begin with milder
        readings than the fault: live, a busy host ran every replica 1.45x predicted from
        iteration 6, one of them was suspected at 9, and the 3x slowdown injected at 10 was
        what its probes (at 10, one iteration after the suspicion) found. Its streak, which
        goes on while the subject is probed and held, then shows the step up at 10.
        """
        if suspicion.kind == "recovery":
            return suspicion.onset_iteration
        streak = (self._link_streak.get(suspicion.links[0]) if suspicion.kind == "link"
                  else self._group_streak.get((suspicion.replica, suspicion.stage)))
        if streak is None or streak.count == 0 or streak.onset != suspicion.onset_iteration:
            return suspicion.onset_iteration  # the streak broke since: nothing newer to go by
        return streak.step_onset(self.config.slowdown_threshold, self._persistence())

    # ---------------------------------------------------------------- helpers

    def _group_factors(self, rank_factors, groups) -> dict[GroupId, float]:
        """Each of ``groups`` holding a rank of ``rank_factors``: the largest factor among its ranks."""
        out: dict[GroupId, float] = {}
        for rank, factor in rank_factors.items():
            g = self._rank_group.get(rank)
            if g in groups:
                out[g] = max(out.get(g, 1.0), factor)
        return out

    def _group(self, observations):
        """``op_signals.group_by_stage``, remembering each group's ranks for the suspicions."""
        groups, feats = group_by_stage(observations)
        for g, obs in groups.items():
            self._group_ranks[g] = tuple(o.rank for o in obs)
            self._rank_group.update((o.rank, g) for o in obs)
        return groups, feats

    def keys_for(self, replica: int, stage: int, tp_degree: int) -> tuple[Hashable, Hashable]:
        """The predictor keys ``(forward, backward)`` a group uses (for ``predict_replica``)."""
        sig = self._signature(replica, stage, tp_degree)
        return ((sig, "F"), (sig, "B"))

    def _transfer_s(self, up: GroupId, down: GroupId) -> float:
        """One healthy transfer from stage group ``up`` to ``down``: the group waits for its slowest
        TP pair, so the largest baseline among their pairs (0 before any is known)."""
        pairs = zip(self._group_ranks[up], self._group_ranks[down])
        known = [self._links.base[pair] for pair in pairs if pair in self._links.base]
        return max(known) if known else 0.0
