"""How the schedule hooks time an op: busy clock, injected slowdown, emulated dedicated device."""

import time

import pytest

from megatron.resihp.schedules import OpRecorder, wait_until
from tests.host_clock_event import HostClockEvent
from resihp_ext.schedule import OpKind


def _spin(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def _timed_spin(recorder: OpRecorder, seconds: float) -> tuple[float, float]:
    """(wall seconds, recorded device seconds) of one forward op that computes for ``seconds``."""
    recorder.start_iteration()
    recorder.timed(OpKind.FORWARD, _spin, seconds)
    recorder.active = False
    (_, _, start, end), = recorder.ops
    return end - start, recorder.busy[0]


def test_cpu_busy_time_is_the_compute_and_a_slowdown_computes_longer():
    recorder = OpRecorder()
    recorder.use_device("cpu")
    _, busy = _timed_spin(recorder, 0.02)
    assert 0.02 <= busy < 0.04
    recorder.slowdown_factor = 2.0
    _, slowed = _timed_spin(recorder, 0.02)
    assert 0.04 <= slowed < 0.07  # the extra time is spent computing, so it shows as busy time


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_emulated_device_op_lasts_scale_times_its_cpu_time(factor):
    recorder = OpRecorder()
    recorder.use_device("cpu", cpu_device_time_scale=4.0)
    recorder.slowdown_factor = factor
    cpu_start = time.thread_time()
    wall, device = _timed_spin(recorder, 0.02)
    cpu = time.thread_time() - cpu_start
    assert 4.0 * factor * 0.02 <= device < 4.0 * factor * 0.04
    assert wall >= device  # the host waited out the emulated device time
    assert cpu < 0.5 * device  # ... by sleeping, leaving the core to the other ranks


def test_device_time_scale_is_ignored_on_cuda():
    recorder = OpRecorder()
    recorder.device_time_scale = 4.0
    recorder.use_device("cuda", cpu_device_time_scale=4.0)
    assert recorder.device_time_scale == 0.0


def test_a_short_op_on_a_wall_clock_device_is_stretched_by_the_factor_not_by_the_os_wake_up():
    """On a GPU the host waits out an injected slowdown. The probe GEMM lasted 0.2 ms on an H100, and
    waited out with a plain sleep (which wakes ~0.1 ms late) a 1.5x slowdown read 2.45x there."""
    recorder = OpRecorder()
    recorder.use_device("cuda")  # only picks the clocks; nothing here touches a GPU
    recorder.slowdown_factor = 1.5
    op_s = 2e-4
    waits = []
    for _ in range(51):
        start = time.perf_counter()
        recorder.stretch(op_s)
        waits.append(time.perf_counter() - start)
    waits.sort()
    assert waits[0] >= 0.5 * op_s  # never short of the factor
    assert waits[len(waits) // 2] < 0.7 * op_s  # the median within 1.2 of the extra 0.1 ms wanted


def _event_recorder(factor: float = 1.0) -> tuple[OpRecorder, list[str]]:
    recorder = OpRecorder()
    recorder.use_device("cuda")  # picks the clocks and events; the events are replaced below
    host_waits = []
    recorder.synchronize = lambda: host_waits.append("synchronize")
    recorder.device_event = HostClockEvent
    recorder.slowdown_factor = factor
    HostClockEvent.waits = 0
    return recorder, host_waits


def _wait(seconds: float) -> None:
    wait_until(time.perf_counter() + seconds)


def test_on_cuda_ops_are_timed_by_events_read_once_after_the_schedule():
    """A device wait around every op stalls the host once per op; with events there is one wait at
    the iteration's start and one when the times are read."""
    recorder, host_waits = _event_recorder()
    recorder.start_iteration()
    schedule = [(OpKind.FORWARD, 0.004), (OpKind.FORWARD, 0.002), (OpKind.BACKWARD, 0.008), (OpKind.BACKWARD, 0.004)]
    for kind, seconds in schedule:
        recorder.timed(kind, _wait, seconds)
        _wait(0.001)  # a pipeline transfer between ops
    assert recorder.ops == [] and HostClockEvent.waits == 1  # nothing read, nothing waited for yet
    recorder.active = False
    recorder.collect()
    assert host_waits == [] and HostClockEvent.waits == 2
    assert [(kind, mb) for kind, mb, _, _ in recorder.ops] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert recorder.ops[0][2] >= recorder.iteration_start_s
    for (_, _, start, end), busy, (_, seconds) in zip(recorder.ops, recorder.busy, schedule):
        assert end - start == pytest.approx(busy, abs=1e-9)
        assert seconds <= busy < seconds + 0.004
    gaps = [b[2] - a[3] for a, b in zip(recorder.ops, recorder.ops[1:])]
    assert all(0.001 <= gap < 0.005 for gap in gaps)  # the transfers stay between the ops
    recorder.collect()
    assert len(recorder.ops) == 4  # read once


def test_on_cuda_an_injected_slowdown_stretches_each_op_and_its_end_event():
    recorder, _ = _event_recorder(factor=2.0)
    recorder.start_iteration()
    recorder.timed(OpKind.FORWARD, _wait, 0.005)
    recorder.active = False
    recorder.collect()
    (_, _, start, end), = recorder.ops
    assert 0.010 <= end - start < 0.016
    assert recorder.busy[0] == pytest.approx(end - start, abs=1e-9)
