"""The training loop's resilience hooks: fault injection, detection, adaptation.

Responsible for executing what ``resihp_ext`` decides, at iteration boundaries: applying
injected faults to this process (stretching compute, SIGKILL, hanging), feeding op timings to the
detector and acting on its verdicts. ``build_resilience`` returns ``None`` when no ``--resihp-*``
feature is on, so the loop then runs exactly like stock Megatron.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch.distributed as dist
from megatron.core import parallel_state

from megatron.training.logging_utils import EventLog, log_line
from megatron.training.schedules import RECORDER
from resihp_ext.faults import FaultKind


class ResilienceHooks:
    def __init__(self, args: argparse.Namespace, events: EventLog):
        self.args = args
        self.events = events
        self.rank = dist.get_rank()
        self.replica_index = parallel_state.get_data_parallel_rank()
        self.faults = [f for f in args.resihp.faults if f.rank == self.rank]

    def _apply_faults(self, iteration: int) -> None:
        for fault in self.faults:
            if fault.at_iteration != iteration:
                continue
            self.events.emit("inject", iteration, fault=fault.spec())
            log_line(f" rank {self.rank}: injecting {fault.spec()}")
            if fault.kind is FaultKind.SLOW:
                RECORDER.slowdown_factor = fault.factor
            elif fault.kind is FaultKind.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                while True:  # a hung rank: alive, holding its sockets, making no progress
                    time.sleep(3600)

    def before_iteration(self, iteration: int, objects, quotas):
        self._apply_faults(iteration)
        return objects, quotas

    def after_iteration(self, iteration: int, elapsed_s: float, result, objects, quotas):
        return objects, quotas

    def close(self) -> None:
        pass


def build_resilience(args: argparse.Namespace, events: EventLog, objects) -> ResilienceHooks | None:
    cfg = args.resihp
    if not (cfg.detection_on or cfg.inject):
        return None
    return ResilienceHooks(args, events)
