"""Peer systems' fail-slow detectors, modelled after their descriptions, fed the same observations as ours.

* ``GreyhoundStyleDetector``: change-point detection on the raw iteration time (after the
  published Greyhound description: an online change-point test on iteration durations flags a
  slowdown when the mean shifts up by at least 10%). It knows nothing about the data, so a block
  of long documents looks exactly like a slow GPU.
* ``NvrxStyleDetector``: a relative performance score per rank (after nvidia-resiliency-ext's
  straggler detection: the best rank's median op time divided by the rank's, over a report
  window, compared among ranks that run the same section; a score under 0.75 flags the rank).
  Replicas that read different data differ in op time for the same section, so it is fooled too.

Both read per-op times as the ops' busy times (``RankObservation.op_busy``), the signal ours reads.
Both are written from those descriptions, not from their code, and are deliberately simple. They
must never be used to make decisions in training; they exist to be measured against.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from resihp_ext.detection.detector import RankObservation


@dataclass(frozen=True)
class Alarm:
    """A baseline detector's alarm.

    Attributes:
        iteration: iteration at which it fired.
        ranks: ranks it blames (may be empty when it cannot localise).
        score: the statistic that fired (mean-shift ratio or performance score).
        reason: one readable line.
    """

    iteration: int
    ranks: tuple[int, ...]
    score: float
    reason: str


class GreyhoundStyleDetector:
    """Online mean-shift change-point test on iteration time.

    Args:
        shift: relative mean increase that counts as a slowdown (0.10 = 10%).
        reference_iters: length of the reference window before a candidate change point.
        test_iters: length of the window after it.
        z: significance of the shift (Welch statistic) required as well.
        warmup_iters: iterations ignored at the start.
    """

    def __init__(self, shift: float = 0.10, reference_iters: int = 20, test_iters: int = 3, z: float = 3.0,
                 warmup_iters: int = 5) -> None:
        if shift <= 0 or reference_iters < 2 or test_iters < 1:
            raise ValueError("need shift > 0, reference_iters >= 2, test_iters >= 1")
        self.shift, self.z, self.warmup_iters = shift, z, warmup_iters
        self.reference_iters, self.test_iters = reference_iters, test_iters
        self._times: deque[float] = deque(maxlen=reference_iters + test_iters)
        self._busy: deque[dict[int, float]] = deque(maxlen=reference_iters + test_iters)
        self._seen = 0

    def observe(self, iteration: int, observations: Sequence[RankObservation]) -> Alarm | None:
        self._seen += 1
        if not observations or self._seen <= self.warmup_iters:
            return None
        self._times.append(float(np.median([o.iteration_s for o in observations])))
        self._busy.append({o.rank: sum(o.op_busy()) for o in observations})
        if len(self._times) < self._times.maxlen:
            return None
        values = np.array(self._times)
        ref, test = values[: self.reference_iters], values[self.reference_iters:]
        ratio = test.mean() / ref.mean()
        spread = np.sqrt(ref.var(ddof=1) / len(ref) + (test.var(ddof=1) if len(test) > 1 else 0.0) / len(test))
        zscore = (test.mean() - ref.mean()) / max(spread, 1e-12)
        if ratio - 1.0 < self.shift or zscore < self.z:
            return None
        # Localise as the per-worker follow-up does: ranks whose own compute grew most.
        before = self._rank_means(range(self.reference_iters))
        after = self._rank_means(range(self.reference_iters, len(self._busy)))
        growth = {r: after[r] / before[r] for r in after if before.get(r, 0) > 0}
        top = max(growth.values(), default=1.0)
        blamed = tuple(sorted(r for r, g in growth.items() if g >= top * 0.98))
        # A detected change point starts a new regime: the reference restarts from here.
        self._times.clear()
        self._busy.clear()
        return Alarm(iteration, blamed, float(ratio),
                     f"iteration time mean shifted {100 * (ratio - 1):.1f}% (z={zscore:.1f})")

    def _rank_means(self, window) -> dict[int, float]:
        sums: dict[int, list[float]] = defaultdict(list)
        for i in window:
            for rank, busy in self._busy[i].items():
                sums[rank].append(busy)
        return {r: float(np.mean(v)) for r, v in sums.items()}


class NvrxStyleDetector:
    """Relative per-rank performance score over report windows.

    Args:
        threshold: a rank whose score (best median op time / its median op time) falls below this
            is flagged.
        report_iters: iterations per report window.
        warmup_iters: iterations ignored at the start.
    """

    def __init__(self, threshold: float = 0.75, report_iters: int = 5, warmup_iters: int = 5) -> None:
        if not 0 < threshold < 1 or report_iters < 1:
            raise ValueError("need 0 < threshold < 1 and report_iters >= 1")
        self.threshold, self.report_iters, self.warmup_iters = threshold, report_iters, warmup_iters
        self._op_times: dict[int, list[float]] = defaultdict(list)
        self._section: dict[int, int] = {}
        self._seen = 0

    def observe(self, iteration: int, observations: Sequence[RankObservation]) -> Alarm | None:
        self._seen += 1
        if self._seen <= self.warmup_iters:
            return None
        for o in observations:
            self._section[o.rank] = o.stage  # same stage = same layers = same section
            self._op_times[o.rank].extend(b for (kind, *_), b in zip(o.ops, o.op_busy()) if kind == "F")
        if (self._seen - self.warmup_iters) % self.report_iters:
            return None
        medians = {r: float(np.median(v)) for r, v in self._op_times.items() if v}
        self._op_times.clear()
        best: dict[int, float] = {}
        for rank, med in medians.items():
            section = self._section[rank]
            best[section] = min(best.get(section, np.inf), med)
        scores = {r: best[self._section[r]] / m for r, m in medians.items() if m > 0}
        flagged = tuple(sorted(r for r, s in scores.items() if s < self.threshold))
        if not flagged:
            return None
        worst = min(scores[r] for r in flagged)
        return Alarm(iteration, flagged, float(worst),
                     f"{len(flagged)} ranks scored below {self.threshold} (worst {worst:.2f})")
