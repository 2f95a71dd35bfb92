"""How late a loaded host lets heartbeats run, and the dead verdict that allows for it.

Responsible for: telling a rank that died from one whose heartbeat was merely late because the
host ran short of CPU. A beacon is a separate process that beats whatever its rank does, so a
beat that arrives late means the beacon itself was not scheduled: the host (or the store) ran
late, and every process on it ran late together, the watcher included. Two things show that
without any clock but the ones heartbeats already carry:

* the beats that do arrive: a beacon whose next beat comes ``gap`` seconds after its previous one
  was held back ``gap - interval_s``; a dead beacon sends no next beat, so a death never counts;
* the watcher's own poll loop: waking ``lateness`` seconds after it asked to.

``HostLateness`` keeps the largest of these seen over a recent window, and
``judge_heartbeats_under_load`` allows a heartbeat that much longer before calling it dead. It
also names nobody while no heartbeat at all is fresh (this rank's own included): then it is the
host or the store that stands still, not every other rank at once.

A real death is not slowed where a beacon is there to mark it (``dead`` at once); only a rank lost
with its beacon (a lost node) is named up to ``cap_s`` later on a host that was running late.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class HostLateness:
    """The largest lateness a host showed over the last ``window_s`` seconds.

    Args:
        interval_s: the heartbeat interval: a beat ``interval_s`` after the previous one is on time.
        window_s: how long a lateness seen is remembered.
        cap_s: the most lateness ever allowed, so a lost rank is still named on a host that is
            always late.
    """

    def __init__(self, interval_s: float, window_s: float, cap_s: float) -> None:
        if interval_s <= 0 or window_s <= 0 or cap_s < 0:
            raise ValueError(f"host lateness: interval_s and window_s must be > 0 and cap_s >= 0, got "
                             f"{interval_s}, {window_s}, {cap_s}")
        self.interval_s = interval_s
        self.window_s = window_s
        self.cap_s = cap_s
        self._seen: deque[tuple[float, float]] = deque()  # (when, lateness), latenesses decreasing
        self._last_beat: dict[int, float] = {}

    def beats(self, now: float, beat_at: Mapping[int, float]) -> None:
        """Record the latest heartbeat time of each rank read at ``now``.

        A rank whose beat moved from ``t0`` to ``t1`` beat ``t1 - t0 - interval_s`` late. A beat
        read for the first time, or older than the one recorded (a new generation), counts nothing.
        """
        for rank, at in beat_at.items():
            before = self._last_beat.get(rank)
            self._last_beat[rank] = at
            if before is not None and at > before:
                self._add(now, at - before - self.interval_s)

    def poll(self, now: float, lateness_s: float) -> None:
        """Record that the watcher's own poll woke ``lateness_s`` after it was due."""
        self._add(now, lateness_s)

    def allowance(self, now: float) -> float:
        """Seconds a heartbeat may run late now, in ``[0, cap_s]``."""
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        return min(self.cap_s, max((late for _, late in self._seen), default=0.0))

    def _add(self, now: float, late: float) -> None:
        if late <= 0:
            return
        # Keep only entries that a later, larger one does not outlive: the front is the maximum.
        while self._seen and self._seen[-1][1] <= late:
            self._seen.pop()
        self._seen.append((now, late))


def judge_heartbeats_under_load(now: float, last_beat: Mapping[int, float], timeout_s: float,
                                allowance_s: float = 0.0, freshest_beat: float | None = None) -> frozenset[int]:
    """Ranks whose heartbeat is older than ``timeout_s`` plus what the host's lateness allows.

    Args:
        now: current time on the heartbeats' clock.
        last_beat: rank -> its latest heartbeat time, for the ranks being judged.
        timeout_s: heartbeat timeout on a host that runs on time.
        allowance_s: how late the host has let heartbeats run (``HostLateness.allowance``).
        freshest_beat: the newest heartbeat read from any rank, this one's included; when even
            that is older than the timeout, the host or the store stood still and nobody is named.

    Returns:
        The ranks judged dead.
    """
    if timeout_s <= 0:
        raise ValueError(f"--resihp-heartbeat-timeout-s must be > 0, got {timeout_s}")
    if allowance_s < 0:
        raise ValueError(f"heartbeat lateness allowance must be >= 0, got {allowance_s}")
    if freshest_beat is not None and now - freshest_beat > timeout_s + allowance_s:
        return frozenset()
    return frozenset(rank for rank, beat in last_beat.items() if now - beat > timeout_s + allowance_s)
