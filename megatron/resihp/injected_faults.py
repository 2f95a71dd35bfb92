"""Injected faults of one process, struck from outside the step: kills, hangs, slowdowns, slow links.

Responsible for the ``--resihp-inject`` faults aimed at this rank (a link fault at its receiver
too) that the resilience hooks strike at an iteration's start or in a named phase of a save, a
recovery, the loop's log or its end: a SIGKILL of this process; a hang (alive, holding its
sockets, making no progress); this rank's compute stretched by its slowest active slowdown
(``schedules.RECORDER``; one waiting for a re-plan from the iteration after it), with an
``inject`` event as each starts and an ``inject_end`` as it ends or pauses; a link slowed after
its healthy speed was measured with the receiver; and a checkpoint save whose writes wait
(``stall_in_save``). Faults follow the process across re-formed worlds. Errors raised inside the
step are ``raised_faults.py``'s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from megatron.resihp.detection import link_probe_bytes, link_seconds_per_byte
from megatron.resihp.link_faults import LINKS
from megatron.resihp.logging_utils import log_line
from megatron.resihp.schedules import RECORDER
from resihp_ext.faults import FaultKind


class InjectedFaults:
    """The faults of one rank, and striking them.

    Args:
        faults: every fault of the job; those naming ``rank`` (as the rank, or as a link's receiver)
            are kept.
        events: the event log.
        me: this rank's name in log lines now (it changes as worlds re-form).
    """

    def __init__(self, faults, rank: int, events, me: Callable[[], str]):
        self.faults = [f for f in faults if rank in (f.rank, f.dst)]
        self._slowing: set = set()  # slow faults in force now
        # Slowdowns that wait for a phase (during=replan): the iteration each begins, once it came.
        self._begins: dict = {}
        self.events = events
        self._me = me

    def _say(self, iteration: int, fault, **extra) -> None:
        self.events.emit("inject", iteration, fault=fault.spec(), **extra)
        log_line(f" {self._me()}: injecting {fault.spec()}")

    def in_phase(self, iteration: int, phase: str) -> None:
        """SIGKILL this process if a kill is aimed at ``phase`` (of a recovery, a save, the step,
        the job's end) of ``iteration``; a slowdown waiting for it begins with the next iteration."""
        for fault in self.faults:
            if fault.during != phase or not fault.active(iteration):
                continue
            if fault.kind is FaultKind.SLOW:
                self._begins.setdefault(fault, iteration + 1)
            elif fault.kind is FaultKind.KILL:
                self._say(iteration, fault)
                os.kill(os.getpid(), signal.SIGKILL)

    def forget_before(self, iteration: int) -> None:
        """After a fail-stop recovery at ``iteration``: a slowdown under way keeps its end; slowed
        links name old ranks, so they go."""
        self.faults = [f for f in self.faults if f.at_iteration > iteration or (f.until_iteration or 0) > iteration
                       or (f.kind is FaultKind.SLOW and f.until_iteration is None)
                       or f.kind is FaultKind.STALL]  # waits for a save; gone once it struck
        LINKS.clear()

    def stall_in_save(self, iteration: int) -> float:
        """Seconds the writes of this rank's save of ``iteration`` wait: the stalls due by then, each
        struck once (0.0: none)."""
        due = [f for f in self.faults if f.kind is FaultKind.STALL and f.at_iteration <= iteration]
        for fault in due:
            self.faults.remove(fault)
            self._say(iteration, fault)
        return max((f.seconds for f in due), default=0.0)

    def _slowdowns(self, iteration: int) -> None:
        """Stretch this rank's compute by its slowest active slowdown, and say when each starts and ends
        (an intermittent one at every burst). Recomputed each iteration, so a redone iteration or a
        re-plan in the middle of a burst keeps the fault where it stands."""
        for fault in (f for f in self.faults if f.kind is FaultKind.SLOW):
            now = fault.active(iteration) if fault.during is None else iteration >= self._begins.get(fault, iteration + 1)
            if now == (fault in self._slowing):
                continue
            if now:
                self._slowing.add(fault)
                self._say(iteration, fault)
            else:
                self._slowing.discard(fault)
                self.events.emit("inject_end", iteration, fault=fault.spec())
                ended = fault.until_iteration is not None and iteration >= fault.until_iteration
                log_line(f" {self._me()}: {fault.spec()} {'pauses' if fault.intermittent and not ended else 'ends'}")
        RECORDER.slowdown_factor = max((f.factor for f in self._slowing), default=1.0)

    def at_start(self, iteration: int, args, device, standing_by: bool = False) -> None:
        """The faults of ``iteration``'s start: slowdowns, slowed links (measured on ``device``),
        kills and hangs; a standby takes only its slowdowns."""
        self._slowdowns(iteration)
        for fault in self.faults:
            if standing_by and fault.kind in (FaultKind.LINK, FaultKind.HANG):
                continue  # a standby sends nothing and makes no progress that could stop
            if (fault.kind in (FaultKind.SLOW, FaultKind.STALL) or fault.at_iteration != iteration
                    or fault.during is not None):
                continue
            if fault.kind is FaultKind.LINK:
                self._slow_link(iteration, fault, args, device)
                continue
            self._say(iteration, fault)
            if fault.kind is FaultKind.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                while True:  # a hung rank: alive, holding its sockets, making no progress
                    time.sleep(3600)

    def _slow_link(self, iteration: int, fault, args, device) -> None:
        """Measure the healthy link with its receiver, then slow this rank's sends over it."""
        per_byte = link_seconds_per_byte(fault.src, fault.dst, device, link_probe_bytes(args))
        if per_byte is None:  # the receiver
            return
        LINKS.slow(fault.dst, fault.factor, per_byte)
        self.events.emit("inject", iteration, fault=fault.spec(), healthy_s_per_mib=per_byte * 2**20)
        log_line(f" {self._me()}: injecting {fault.spec()} (healthy link {per_byte * 2**20 * 1e3:.3f} ms/MiB)")
