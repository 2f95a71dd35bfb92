"""Intermittent fail-slows: a rank that probes slow again and again, but never twice in a row.

A compute verdict waits for a second probe round (``resihp_ext.detection.confirmation``) so that a device
slow for a moment, such as one beside a busy neighbour, is not re-planned around. A device slow
in bursts shorter than that wait (a clock that throttles and recovers every few iterations) is
dropped the same way at every burst: each burst raises a suspicion, the first round names the
rank, the second finds it fast. Every burst still stalls the whole job, since every other rank
waits for it in the pipeline or the gradient all-reduce.

This module remembers those dropped verdicts. When one rank has been named by ``episodes``
first rounds and dropped by every second round, all within ``window_iters`` iterations, it is
slow in bursts, and the module returns a compute verdict for it. The verdict's factor is the
median of its first rounds' probe factors (its speed while a burst lasts); its evidence holds the
share of the iterations since the first burst in which the rank's group ran slow, which a plan
weighs the bursts by (``resihp_ext.planner.bursts``).

Pure: fed verdicts, returns verdicts; it never probes or reads clocks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from resihp_ext.detection.validation import Verdict, VerdictKind


@dataclass(frozen=True)
class Episode:
    """One burst: a first probe round named the rank, the second did not.

    Attributes:
        onset_iteration: where the first round's verdict dated the slowdown.
        suspicion_iteration: iteration of the suspicion that was probed.
        probe_iteration: iteration of the first round.
        dropped_iteration: iteration of the second round that dropped it.
        factor: the rank's probe factor in the first round.
        factor_after: its probe factor in the second round (None when not probed again).
    """

    onset_iteration: int
    suspicion_iteration: int
    probe_iteration: int
    dropped_iteration: int
    factor: float
    factor_after: float | None


class Recurrences:
    """Dropped compute verdicts per rank, and the intermittent verdicts they add up to.

    Args:
        episodes: dropped verdicts of one rank that make it slow in bursts
            (``--resihp-intermittent-episodes``); 0 turns this off.
        window_iters: iterations within which they must all fall
            (``--resihp-intermittent-window-iters``).
    """

    def __init__(self, episodes: int, window_iters: int) -> None:
        if episodes < 0 or episodes == 1:
            raise ValueError(f"--resihp-intermittent-episodes must be 0 (off) or >= 2, got {episodes}")
        if window_iters < 1:
            raise ValueError(f"--resihp-intermittent-window-iters must be >= 1, got {window_iters}")
        self.episodes = episodes
        self.window_iters = window_iters
        self._seen: dict[int, deque[Episode]] = defaultdict(deque)

    def note(self, dropped: Verdict, again_factors: dict, iteration: int,
             slow_share: Callable[[int, int], float | None] = lambda first, last: None) -> Verdict | None:
        """Remember a first-round compute verdict that the second round at ``iteration`` dropped.

        Args:
            dropped: the first round's verdict.
            again_factors: the second round's probe factors (rank -> factor).
            iteration: the iteration of the second round.
            slow_share: the share of its group's iterations ``first..last`` that ran slow
                (``FailSlowDetector.slow_share``), for the verdict's evidence. It is asked for
                the iterations from the first burst's onset to the one before the last burst's, a
                whole number of periods when the bursts come regularly.

        Returns:
            A compute verdict for the ranks now dropped ``episodes`` times within the window
            (whose episodes are then forgotten), or None.
        """
        if self.episodes == 0 or dropped.kind is not VerdictKind.COMPUTE:
            return None
        for rank in dropped.ranks:
            seen = self._seen[rank]
            seen.append(Episode(
                onset_iteration=dropped.iteration,
                suspicion_iteration=int(dropped.evidence.get("suspicion_iteration", dropped.iteration)),
                probe_iteration=int(dropped.evidence.get("probe_iteration", dropped.iteration)),
                dropped_iteration=iteration,
                factor=dropped.factor_of(rank),
                factor_after=again_factors.get(rank),
            ))
            while seen and seen[0].probe_iteration <= iteration - self.window_iters:
                seen.popleft()
        ready = sorted(r for r in dropped.ranks if len(self._seen[r]) >= self.episodes)
        if not ready:
            return None
        bursts = {r: list(self._seen.pop(r)) for r in ready}
        onsets = sorted(e.onset_iteration for episodes in bursts.values() for e in episodes)
        return _intermittent_verdict(bursts, self.window_iters, onsets[0], onsets[-1] - 1,
                                     slow_share(onsets[0], onsets[-1] - 1))


def _intermittent_verdict(bursts: dict[int, list[Episode]], window_iters: int, onset: int, share_until: int,
                          share: float | None) -> Verdict:
    factors = {r: statistics.median(e.factor for e in episodes) for r, episodes in bursts.items()}
    last = max((e for episodes in bursts.values() for e in episodes), key=lambda e: e.dropped_iteration)
    named = "; ".join(
        f"rank {r} at " + ", ".join(f"{e.factor:.2f}x (probe {e.probe_iteration})" for e in episodes)
        for r, episodes in sorted(bursts.items()))
    evidence = {
        "intermittent": True,
        "probe_factors": {str(r): round(f, 4) for r, f in factors.items()},
        "episodes": {str(r): [{"suspicion": e.suspicion_iteration, "probe": e.probe_iteration,
                               "dropped": e.dropped_iteration, "factor": round(e.factor, 4),
                               "factor_after": None if e.factor_after is None else round(e.factor_after, 4)}
                              for e in episodes] for r, episodes in bursts.items()},
        "slow_share": None if share is None else round(share, 4),
        "onset_iteration": onset,
        "suspicion_iteration": last.suspicion_iteration,
        "probe_iteration": last.probe_iteration,
    }
    count = len(next(iter(bursts.values())))
    share_text = "" if share is None else f", its group slow in {share:.0%} of iterations {onset}-{share_until}"
    reason = (f"slow in bursts: probed slow in {count} suspicions within {window_iters} iterations ({named}), "
              f"fast again by each second round{share_text}; judged at the median burst slowdown")
    return Verdict(VerdictKind.COMPUTE, tuple(sorted(bursts)), max(factors.values()), onset, evidence, reason,
                   probe_factors={r: round(f, 4) for r, f in factors.items()}, intermittent=True,
                   slow_share=None if share is None else round(share, 4))
