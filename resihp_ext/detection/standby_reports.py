"""What a standby reports of its device: the slowdown the working ranks decide readmission on.

A standby times the validation probe on its device every few seconds (``megatron/resihp/standby.py``)
and reports the least slowdown of its latest ``REPORTED_PROBES`` probes. Interference on a shared
host only adds time, so one disturbed probe must not make a healthy standby look slow: a replica's
standbys come back only when all of them look healthy at once, and under load (2 cores, other jobs)
the two healthy standbys of a replica were seen ready in turns, never together, so that the
replica never came back (a single disturbed probe per report the likelier cause). A standby that
turns slow again shows it ``REPORTED_PROBES`` probes later.

Pure: no clocks, no devices.
"""

from __future__ import annotations

import collections

REPORTED_PROBES = 3


class StandbySlowdown:
    """A standby's latest probe slowdowns (probe seconds over its healthy reference)."""

    def __init__(self, probes: int = REPORTED_PROBES):
        if probes < 1:
            raise ValueError(f"a standby reports over at least one probe, got {probes}")
        self._recent: collections.deque[float] = collections.deque(maxlen=probes)

    def add(self, factor: float) -> float:
        """Record one probe's slowdown; returns what the standby reports now."""
        self._recent.append(factor)
        return self.reported

    @property
    def reported(self) -> float:
        """The least slowdown of the latest probes."""
        if not self._recent:
            raise ValueError("no probe timed yet")
        return min(self._recent)
