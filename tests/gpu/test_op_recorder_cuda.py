"""The schedule hooks time ops on a GPU with events, without making the host wait for the device;
skipped without a GPU."""

import statistics
import time

import pytest
import torch

from megatron.resihp.schedules import OpRecorder
from resihp_ext.schedule import OpKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GEMMS_PER_OP = 8


def _op(a, b):
    for _ in range(GEMMS_PER_OP):
        a = torch.tanh(a @ b)
    return a


def _operands():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", generator=g)
    b = torch.randn(2048, 2048, device="cuda", generator=g) / 2048**0.5
    _op(a, b)
    torch.cuda.synchronize()
    return a, b


def _recorded_busy(recorder: OpRecorder, a, b, ops: int = 5) -> tuple[list[float], float]:
    """(busy seconds per op, host seconds from the iteration's start to the last op's return)."""
    recorder.start_iteration()
    for _ in range(ops):
        recorder.timed(OpKind.FORWARD, _op, a, b)
    host_s = time.perf_counter() - recorder.iteration_start_s
    recorder.active = False
    recorder.collect()
    return recorder.busy, host_s


def test_ops_are_timed_on_the_device_while_the_host_runs_ahead(monkeypatch):
    a, b = _operands()
    bracketed = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _op(a, b)
        torch.cuda.synchronize()
        bracketed.append(time.perf_counter() - start)
    recorder = OpRecorder()
    recorder.use_device("cuda")
    waits = []
    recorder.synchronize = lambda: waits.append("recorder")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append("torch"))
    busy, host_s = _recorded_busy(recorder, a, b)
    assert waits == []
    assert host_s < 0.5 * sum(busy)  # the host queued every op long before the device ran them
    assert statistics.median(busy) == pytest.approx(statistics.median(bracketed), rel=0.15)
    starts_ends = [t for _, _, start, end in recorder.ops for t in (start, end)]
    assert starts_ends == sorted(starts_ends) and starts_ends[0] >= recorder.iteration_start_s


def test_an_injected_slowdown_stretches_each_op_by_its_factor():
    a, b = _operands()
    recorder = OpRecorder()
    recorder.use_device("cuda")
    healthy, _ = _recorded_busy(recorder, a, b)
    recorder.slowdown_factor = 1.5
    slowed, _ = _recorded_busy(recorder, a, b)
    assert statistics.median(slowed) / statistics.median(healthy) == pytest.approx(1.5, rel=0.1)
