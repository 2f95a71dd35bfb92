"""Verdicts that wait for a second probe round before anyone acts on them.

Responsible for the bookkeeping between a first probe round naming a slow rank or link and the
second round, ``confirm_after_iters`` iterations later, that must name it again: which verdicts
wait, which are due, and what a second round makes of each (the confirmed verdict, or a Cleared).

A compute verdict the second round drops is handed to ``resihp_ext.detection.recurrence``: a rank dropped
that way again and again is slow in bursts, and becomes a verdict of its own.

Several verdicts may wait at once. A suspicion raised while another verdict waits is probed at
once and waits beside it, so a noise verdict on one link cannot hold back a real slowdown on
another rank until its cooldown ends.

Pure: probing is the caller's (``megatron.resihp.detection`` passes a function that runs a
probe round); this module only decides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.observations import Suspicion
from resihp_ext.detection.recurrence import Recurrences
from resihp_ext.detection.validation import Cleared, ProbeResults, Verdict, VerdictKind


# Verdicts a re-plan acts on: what slowed down, and what is fast again.
FAIL_SLOW_KINDS = tuple(kind for kind in VerdictKind if kind.fail_slow)


@dataclass(frozen=True)
class Waiting:
    """A verdict from a first probe round, and the iteration its second round is due."""

    suspicion: Suspicion
    verdict: Verdict
    due_iteration: int


@dataclass(frozen=True)
class ProbePlan:
    """The probe rounds one probe step runs: each due verdict's second round, then a new suspicion's first."""

    due: tuple[Waiting, ...]
    suspicion: Suspicion | None

    @property
    def subjects(self) -> list[Suspicion]:
        """The suspicion behind each round, in the order the rounds run."""
        return [w.suspicion for w in self.due] + ([self.suspicion] if self.suspicion is not None else [])


class PendingVerdicts:
    """Compute, link and recovery verdicts waiting for confirmation, oldest first.

    Args:
        wait_iters: iterations between the first and the second probe round
            (``--resihp-confirm-after-iters``); 0 acts on first-round verdicts at once.
        recurrences: where dropped compute verdicts add up to intermittent ones (None: nowhere).
    """

    def __init__(self, wait_iters: int, recurrences: Recurrences | None = None) -> None:
        if wait_iters < 0:
            raise ValueError(f"--resihp-confirm-after-iters must be >= 0, got {wait_iters}")
        self.wait_iters = wait_iters
        self.recurrences = recurrences
        self._waiting: list[Waiting] = []

    @classmethod
    def from_config(cls, config: ResiHPConfig) -> PendingVerdicts:
        """As the ``--resihp-confirm-after-iters`` and ``--resihp-intermittent-*`` flags say."""
        return cls(config.confirm_after_iters,
                   Recurrences(config.intermittent_episodes, config.intermittent_window_iters))

    def __len__(self) -> int:
        return len(self._waiting)

    def needs_confirmation(self, outcome: Verdict | Cleared) -> bool:
        """Whether a first-round outcome must wait: fail-slow and recovery verdicts do, unless waits are off;
        a Cleared, a hang or a dead verdict never does."""
        return isinstance(outcome, Verdict) and outcome.kind in FAIL_SLOW_KINDS and self.wait_iters > 0

    def hold(self, suspicion: Suspicion, verdict: Verdict, iteration: int) -> Waiting:
        """Queue ``verdict`` (from the probes of ``suspicion`` at ``iteration``) for a second round."""
        waiting = Waiting(suspicion, verdict, iteration + self.wait_iters)
        self._waiting.append(waiting)
        return waiting

    def take_due(self, iteration: int) -> list[Waiting]:
        """Remove and return, oldest first, the verdicts whose second round is due at ``iteration``."""
        due = [w for w in self._waiting if w.due_iteration <= iteration]
        self._waiting = [w for w in self._waiting if w.due_iteration > iteration]
        return due

    @staticmethod
    def settle(waiting: Waiting, again: Verdict | Cleared, iteration: int) -> Verdict | Cleared:
        """What the second round at ``iteration`` makes of a waiting verdict.

        A link verdict is confirmed when the second round names the same link. A compute or
        recovery verdict is confirmed for the ranks both rounds name: a rank that only one round
        names is left to a suspicion of its own, as a busy neighbour can slow one round (seen live:
        a TP sibling probed 1.30x in the first round and 1.00x in the second, while the slow rank
        probed 1.48x and 1.53x). A confirmed rank's or link's factor is the smaller of its two
        rounds' probe factors: a probe's work is fixed (a GEMM, a transfer of fixed bytes), so a
        busy neighbour can only add time, as one round did live (a 1.5x rank probed 1.59x, then
        2.24x). Each factor is against its own round's reference, which ran at the same moments:
        the next round may find the host at another speed (in CI, a 2x rank whose rounds read 2.82x
        and 1.98x came out 2.73x when its fastest seconds were divided by the faster round's
        reference). The onset is the second round's, which saw more of the slowdown. A verdict no
        rank of which is named again becomes a Cleared that names both rounds' probe factors.
        """
        first = waiting.verdict
        evidence = {**first.evidence, "confirm_probe_iteration": iteration,
                    "confirm_probe_factors": again.evidence.get("probe_factors", {})}
        named_again = isinstance(again, Verdict) and again.kind == first.kind
        if first.kind is VerdictKind.LINK:
            kept = tuple(first.ranks) if named_again and set(first.ranks) <= set(again.ranks) else ()
        else:
            kept = tuple(sorted(set(first.ranks) & set(again.ranks))) if named_again else ()
        if not kept:
            return Cleared(iteration, waiting.suspicion.ranks, evidence,
                           f"the probes at iteration {iteration} did not confirm {first.kind} ranks "
                           f"{list(first.ranks)} named at iteration {first.evidence.get('probe_iteration')}; dropped")
        if first.kind is VerdictKind.LINK:  # link factors are only in the record, keyed "src->dst"
            rounds = (first.evidence.get("probe_factors", {}), again.evidence.get("probe_factors", {}))
            named = [f"{kept[0]}->{kept[1]}"]
        else:
            rounds = (first.probe_factors, again.probe_factors)
            named = list(kept)
        both = {k: min(rounds[0][k], rounds[1][k]) for k in rounds[0] if k in rounds[1]}
        factor = first.factor
        if all(k in both for k in named):
            slowest = max(both[k] for k in named)
            factor = max(slowest, 1.0) if first.kind is VerdictKind.RECOVERED else slowest
        elif first.factor is not None and again.factor is not None:
            factor = math.sqrt(first.factor * again.factor)
        reason = f"{first.reason}; confirmed by probes at iteration {iteration}"
        # The second round's conclusion saw more of the subject's streak, so its onset is the later word.
        # (Never after the first round, which already found the slowdown.)
        onset = min(again.iteration, first.evidence.get("probe_iteration", again.iteration))
        if onset != first.iteration:
            reason += f"; began at iteration {onset}, where its readings stepped up"
        dropped = sorted(set(first.ranks) - set(kept))
        if dropped:
            reason += f" for ranks {list(kept)} only (ranks {dropped} not named again)"
        factors = both or rounds[0]
        return dataclasses.replace(first, ranks=kept, factor=factor, reason=reason, iteration=onset,
                                   probe_factors={} if first.kind is VerdictKind.LINK else factors,
                                   evidence={**evidence, "onset_iteration": onset,
                                             "probe_factors": {str(k): f for k, f in factors.items()},
                                             "first_probe_factors": {str(k): f for k, f in rounds[0].items()}})

    def plan_probes(self, iteration: int, suspicion: Suspicion | None) -> ProbePlan:
        """What the probe step at ``iteration`` must probe: the verdicts due by then (taken out of
        the queue) and a new suspicion. Planned ahead when the probes run an iteration after the
        decision (the live job decides on one rank and tells the others what to probe)."""
        return ProbePlan(tuple(self.take_due(iteration)), suspicion)

    def put_back(self, plan: ProbePlan) -> None:
        """Queue again the verdicts of a plan that will not be probed (a re-plan dropped it)."""
        self._waiting = sorted([*plan.due, *self._waiting], key=lambda w: w.due_iteration)

    def settle_probed(self, detector, iteration: int, plan: ProbePlan,
                      rounds: list[ProbeResults]) -> list[tuple[Suspicion, Verdict | Cleared]]:
        """Conclude a plan from its probe rounds (one per ``plan.subjects``, in order), run at ``iteration``.

        Returns:
            ``(suspicion, outcome)`` pairs settled now, oldest first: confirmed verdicts, dropped
            ones (Cleared), and first-round outcomes that need no confirmation. A new fail-slow
            verdict is held, not returned.
        """
        if len(rounds) != len(plan.subjects):
            raise ValueError(f"{len(plan.subjects)} probe rounds planned, {len(rounds)} given")
        settled = []
        for waiting, probes in zip(plan.due, rounds):
            again = detector.conclude(waiting.suspicion, probes)
            outcome = self.settle(waiting, again, iteration)
            if isinstance(again, Verdict) and not isinstance(outcome, Verdict):
                detector.release(waiting.suspicion, iteration)  # slow, but not the same ones
            if isinstance(outcome, Cleared) and self.recurrences is not None:
                group = (waiting.suspicion.replica, waiting.suspicion.stage)
                bursts = self.recurrences.note(waiting.verdict, again.probe_factors, iteration,
                                               functools.partial(detector.slow_share, group))
                if bursts is not None:
                    detector.mute(waiting.suspicion)  # as a first round's verdict does, until a re-plan
                    outcome = bursts
            settled.append((waiting.suspicion, outcome))
        if plan.suspicion is not None:
            outcome = detector.conclude(plan.suspicion, rounds[-1])
            if self.needs_confirmation(outcome):
                self.hold(plan.suspicion, outcome, iteration)
            else:
                settled.append((plan.suspicion, outcome))
        return settled

    def settle_iteration(self, detector, iteration: int, suspicion: Suspicion | None,
                         probe: Callable[[Suspicion], ProbeResults]) -> list[tuple[Suspicion, Verdict | Cleared]]:
        """One iteration's validation, probed at once: probe again the verdicts due, then probe a new
        suspicion (``plan_probes`` and ``settle_probed`` in one step).

        Args:
            detector: the ``FailSlowDetector`` that raised the suspicions (it concludes probe
                rounds and releases what a second round drops).
            iteration: the iteration just judged.
            suspicion: what ``detector.observe`` raised for it, or None.
            probe: runs one probe round for a suspicion and returns its timings.
        """
        plan = self.plan_probes(iteration, suspicion)
        return self.settle_probed(detector, iteration, plan, [probe(s) for s in plan.subjects])
