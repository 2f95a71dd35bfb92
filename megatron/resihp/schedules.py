"""Hooks around megatron-core's pipeline schedules.

Responsible for recording the start and end of every forward and backward of every micro-batch
on this rank (the detector's raw input), and for stretching them when a compute slowdown is
injected. It never decides anything: timings go out as plain tuples.

Each op gets two times. Its wall-clock start and end place it on the job's timeline (pipeline
transfers are the gaps between ops). Its *busy* time is how long the device worked on it, which
is what a device's speed changes. On CUDA both come from timing events recorded around the op on
the device's stream and read once the iteration's schedule is done (``collect``), so the host
queues kernels ahead of the device as it does without the hooks; a synchronize around every op
would stall the host once per op, a cost that grows as ops get shorter. On CPU the two differ
when ranks share cores: a rank's op takes as long in wall time as the scheduler lets it, so busy
time is the main thread's CPU time (``time.thread_time``; with more than one torch thread per
rank, the process's). Measured on a 2-core host with 8 processes running a fixed GEMM: wall time
3.8x the one-process figure with 13% spread, CPU time 1.04x with 4% spread, the same spread as
alone.

Busy time fixes what the detector sees, not how the job runs: ranks sharing cores still slow each
other down, so a pipeline on a small host is bound by its cores, not by its slowest rank. For
measuring what a schedule or a re-plan does to throughput, ``--cpu-device-time-scale K`` makes
every rank act as a dedicated device K times slower than one core: each op's device time is K x
its CPU time (times an injected slowdown), and the host sleeps until the op has taken that long.
With K at least the number of ranks per core, the cores are idle most of the time and the ranks
run as they would on devices of their own. Numerics are unchanged.

The hooks wrap the module-level ``forward_step`` / ``backward_step`` functions that
``megatron.core.pipeline_parallel.schedules`` calls by name, so the order they record is exactly
the order megatron-core executes (asserted against ``resihp_ext.schedule`` in tests).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

from megatron.core.pipeline_parallel import schedules as mcore_schedules

from resihp_ext.schedule import OpKind

OpRecord = tuple[str, int, float, float]  # (kind "F"|"B", micro-batch, start_s, end_s)
# The OS wakes a sleeping thread up to ~0.1 ms late; a wait spins for its last this many seconds.
_SPIN_S = 2e-4


def wait_until(deadline_s: float) -> None:
    """Return once ``time.perf_counter() >= deadline_s``, microseconds late rather than as late as
    the OS wakes a sleeper: stretched by a plain sleep, a GPU op of 0.2 ms slowed 1.5x read 2.45x
    on an H100."""
    remaining = deadline_s - time.perf_counter()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.perf_counter() < deadline_s:
        pass


@dataclasses.dataclass
class OpRecorder:
    """Collects this rank's op timings for one iteration; inactive outside ``train_step``."""

    synchronize: Callable[[], None] = lambda: None
    busy_clock: Callable[[], float] = time.thread_time
    # On CUDA, makes a timing event (record / synchronize / elapsed_time in ms, as torch.cuda.Event).
    device_event: Callable[[], object] | None = None
    slowdown_factor: float = 1.0
    device_time_scale: float = 0.0  # > 0: emulate a dedicated device this many times slower than a core
    active: bool = False
    iteration_start_s: float = 0.0
    ops: list[OpRecord] = dataclasses.field(default_factory=list)
    busy: list[float] = dataclasses.field(default_factory=list)  # per op in ``ops``, device seconds
    features: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    _next_mb: dict[str, int] = dataclasses.field(default_factory=dict)
    _pending: list[tuple[str, int, object, object]] = dataclasses.field(default_factory=list)
    _origin: object | None = None  # event recorded at ``iteration_start_s``

    def use_device(self, device_type: str, cpu_device_time_scale: float = 0.0) -> None:
        """Time ops the way ``device_type`` (``"cuda"`` or ``"cpu"``) measures device work."""
        import torch

        self.device_time_scale = cpu_device_time_scale if device_type == "cpu" else 0.0
        self.device_event = None
        if device_type == "cuda":
            self.synchronize, self.busy_clock = torch.cuda.synchronize, time.perf_counter
            self.device_event = functools.partial(torch.cuda.Event, enable_timing=True)
        else:
            # With intra-op threads (RESIHP_CPU_THREADS > 1) the work is spread over them, so the
            # whole process's CPU time is the closer measure (it also counts the small heartbeat
            # and gloo threads).
            clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
            self.synchronize, self.busy_clock = (lambda: None), clock

    def stretch(self, busy_s: float) -> None:
        """Make the device work ``(slowdown_factor - 1) * busy_s`` longer (an injected slowdown).

        On CPU the rank computes for that long, so the extra time is busy time, as it is for a
        throttled device; elsewhere the host waits, as it would for a slow GPU, to the microsecond
        (``wait_until``), so that short ops are stretched by the factor too.
        """
        extra = (self.slowdown_factor - 1.0) * busy_s
        if extra <= 0:
            return
        if self.busy_clock is not time.perf_counter:  # CPU time: compute for that long
            until = self.busy_clock() + extra
            while self.busy_clock() < until:
                pass
        else:
            wait_until(time.perf_counter() + extra)

    def finish_op(self, start_s: float, busy_start: float) -> float:
        """End an op begun at ``perf_counter() == start_s``; return its device seconds.

        Applies an injected slowdown, and on an emulated device (``device_time_scale``) waits out
        the rest of the op's device time.
        """
        self.synchronize()
        busy = self.busy_clock() - busy_start
        if self.device_time_scale > 0:
            device_s = self.device_time_scale * busy * max(self.slowdown_factor, 1.0)
            remaining = start_s + device_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            return device_s
        if self.slowdown_factor > 1.0:
            self.stretch(busy)
            busy = self.busy_clock() - busy_start
        return busy

    def start_iteration(self) -> None:
        self.ops, self.busy, self.features, self._pending = [], [], [], []
        self._next_mb = {OpKind.FORWARD.value: 0, OpKind.BACKWARD.value: 0}
        self.active = True
        if self.device_event is not None:
            # One wait per iteration, for what the last step left queued (the gradients' zeroing:
            # reading its loss already waited for the rest), so the origin event fires at the host
            # time taken next and every event maps onto the host's clock.
            self._origin = self.device_event()
            self._origin.record()
            self._origin.synchronize()
        self.iteration_start_s = time.perf_counter()

    def timed(self, kind: OpKind, fn: Callable, *args, **kwargs):
        if not self.active:
            return fn(*args, **kwargs)
        mb = self._next_mb[kind.value]
        self._next_mb[kind.value] = mb + 1
        if self.device_event is not None:
            start_event, end_event = self.device_event(), self.device_event()
            start_event.record()
            result = fn(*args, **kwargs)
            end_event.record()
            if self.slowdown_factor > 1.0:  # an injected slowdown needs the op's time now
                end_event.synchronize()
                self.stretch(start_event.elapsed_time(end_event) / 1e3)
                end_event.record()  # the device idled through the host's wait: the op ends with it
            self._pending.append((kind.value, mb, start_event, end_event))
            return result
        result, start, busy = self.run_timed(fn, *args, **kwargs)
        self.ops.append((kind.value, mb, start, time.perf_counter()))
        self.busy.append(busy)
        return result

    def run_timed(self, fn: Callable, *args, **kwargs) -> tuple[object, float, float]:
        """Run ``fn`` as device work timed on the host: ``(its result, its start on perf_counter,
        its device seconds)``, after a synchronize, stretched by an injected slowdown, and on an
        emulated device waited out (``finish_op``). The training ops' CPU path and the GEMM probes."""
        self.synchronize()
        start, busy_start = time.perf_counter(), self.busy_clock()
        result = fn(*args, **kwargs)
        return result, start, self.finish_op(start, busy_start)

    def collect(self) -> None:
        """Turn the iteration's timing events into ``ops`` and ``busy`` (CUDA; a no-op elsewhere).

        Waits for the last op's end event, which the step's loss and gradient norm waited for
        already when this is called after the optimizer step.
        """
        if not self._pending:
            return
        self._pending[-1][3].synchronize()
        origin, origin_s = self._origin, self.iteration_start_s
        for kind, mb, start_event, end_event in self._pending:
            self.ops.append((kind, mb, origin_s + origin.elapsed_time(start_event) / 1e3,
                             origin_s + origin.elapsed_time(end_event) / 1e3))
            self.busy.append(start_event.elapsed_time(end_event) / 1e3)
        self._pending = []


RECORDER = OpRecorder()
_ORIGINAL: dict[str, Callable] = {}


def install_hooks() -> None:
    """Wrap megatron-core's forward_step/backward_step once per process (idempotent)."""
    if _ORIGINAL:
        return
    for name, kind in (("forward_step", OpKind.FORWARD), ("backward_step", OpKind.BACKWARD)):
        original = getattr(mcore_schedules, name)
        _ORIGINAL[name] = original
        setattr(mcore_schedules, name, functools.wraps(original)(functools.partial(RECORDER.timed, kind, original)))


def uninstall_hooks() -> None:
    for name, original in _ORIGINAL.items():
        setattr(mcore_schedules, name, original)
    _ORIGINAL.clear()


@dataclasses.dataclass
class StepTimings:
    """One step's op timings, what the detector reads (``ResilienceHooks.after_iteration``)."""

    ops: list[OpRecord]
    busy: list[float]  # per op, device seconds (see the module docstring)
    features: list[tuple[int, ...]]  # per micro-batch, its cost features
    iteration_s: float  # schedule start to optimizer step end, on this rank
