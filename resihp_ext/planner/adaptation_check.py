"""Whether an applied fail-slow re-plan paid: the trial after it, and the verdict on the trial.

Responsible for judging a re-plan by what it did, not by what the cost model said it would do:
the iterations after it are measured against the iterations before it and against the plan's
prediction. A re-plan after which the job runs no faster than before (by more than the noise
margin) did not pay and is rolled back; one that paid but missed its prediction is kept, because
going back would make the job slower, and the miss is recorded as the cost model's error. A plan
rolled back is not tried again (``RejectedPlans``).

Pure: the executor measures (and makes every rank hold the same numbers), this module decides.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from resihp_ext.layout import Layout


@dataclass(frozen=True)
class AdaptationTrial:
    """A re-plan on trial.

    Attributes:
        iteration: the iteration after which it was applied.
        before_s: the measured iteration seconds just before it (the slowdown it answered included).
        predicted_before_s: what the plan predicted for the old layout under the known slowdowns.
        predicted_after_s: what the plan predicted for itself.
        old_layout, old_quotas: what ran before, to go back to.
        new_layout, new_quotas: what the plan made run.
        settle_iters: iterations right after the change that are not measured (the first runs on
            rebuilt objects).
        window_iters: iterations measured before judging.
        margin: the share by which the job must run faster than before for the plan to count as
            paying (timing noise on a shared host is of this order).
    """

    iteration: int
    before_s: float
    predicted_before_s: float
    predicted_after_s: float
    old_layout: Layout
    old_quotas: tuple[int, ...]
    new_layout: Layout
    new_quotas: tuple[int, ...]
    settle_iters: int = 1
    window_iters: int = 3
    margin: float = 0.05

    def __post_init__(self) -> None:
        if self.window_iters < 1:
            raise ValueError(f"a trial measures at least one iteration, got window_iters={self.window_iters}")
        if self.settle_iters < 0:
            raise ValueError(f"settle_iters must be >= 0, got {self.settle_iters}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not self.before_s > 0:
            raise ValueError(f"before_s must be > 0 (a measured iteration), got {self.before_s}")

    @property
    def iterations_needed(self) -> int:
        """Iterations after the change before the trial can be judged."""
        return self.settle_iters + self.window_iters

    def judge(self, after_s: Sequence[float]) -> TrialVerdict | None:
        """The verdict from the iteration seconds measured since the change (None: too few yet).

        Args:
            after_s: seconds of each iteration after the change, in order, the settling ones first.
        """
        if len(after_s) < self.iterations_needed:
            return None
        measured = statistics.median(after_s[self.settle_iters:self.iterations_needed])
        paid = measured < self.before_s * (1.0 - self.margin)
        error = measured / self.predicted_after_s - 1.0 if self.predicted_after_s > 0 else None
        gain = self.before_s / measured
        if paid:
            reason = (f"kept: {measured:.3f} s per iteration against {self.before_s:.3f} s before "
                      f"({gain:.2f}x faster; predicted {self.predicted_after_s:.3f} s)")
        else:
            reason = (f"rolled back: {measured:.3f} s per iteration against {self.before_s:.3f} s before "
                      f"({gain:.2f}x, not faster by the {self.margin:.0%} margin; predicted "
                      f"{self.predicted_after_s:.3f} s)")
        return TrialVerdict(keep=paid, measured_after_s=measured, before_s=self.before_s,
                            predicted_after_s=self.predicted_after_s, prediction_error=error, reason=reason)


@dataclass(frozen=True)
class TrialVerdict:
    """What a trial found.

    Attributes:
        keep: the re-plan paid; False: go back to the layout and quotas before it.
        measured_after_s: median iteration seconds over the trial's window.
        before_s: the measured iteration seconds before the re-plan.
        predicted_after_s: the plan's prediction for itself.
        prediction_error: measured / predicted - 1 (0.3: the cost model was 30% optimistic); None
            without a prediction.
        reason: a sentence for the log.
    """

    keep: bool
    measured_after_s: float
    before_s: float
    predicted_after_s: float
    prediction_error: float | None
    reason: str


@dataclass(frozen=True)
class RejectedPlans:
    """Plans rolled back in this world, which a later re-plan does not choose again.

    Attributes:
        keys: each rolled-back change as ((layout, quotas) it started from, (layout, quotas) it
            made run): the same target from another starting point is a different change.
        errors: the cost model's error measured at each rollback (``TrialVerdict.prediction_error``).
    """

    keys: frozenset = frozenset()
    errors: tuple[float, ...] = field(default=())

    def rejects(self, old: Layout, old_quotas: Sequence[int], new: Layout, new_quotas: Sequence[int]) -> bool:
        return ((old, tuple(old_quotas)), (new, tuple(new_quotas))) in self.keys

    def with_rollback(self, trial: AdaptationTrial, verdict: TrialVerdict) -> RejectedPlans:
        key = ((trial.old_layout, tuple(trial.old_quotas)), (trial.new_layout, tuple(trial.new_quotas)))
        errors = self.errors + ((verdict.prediction_error,) if verdict.prediction_error is not None else ())
        return RejectedPlans(self.keys | {key}, errors)
