"""An injected storage stall (``stall:`` in ``--resihp-inject``) holds a save's writes back.

Under --async-save the request handed to megatron-core's writer process carries the wait, so the
rank goes on; a synchronous save waits in the rank. Each stall strikes once, at the first save
at or after its iteration.
"""

from __future__ import annotations

import pickle
import time

import pytest

checkpointing = pytest.importorskip("megatron.training.checkpointing")

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # noqa: E402
from megatron.resihp.async_saves import stalled_writes  # noqa: E402
from megatron.resihp.injected_faults import InjectedFaults  # noqa: E402
from resihp_ext.faults import parse_fault  # noqa: E402


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, event, iteration, **fields):
        self.emitted.append((event, iteration, fields))


def test_an_asynchronous_save_hands_its_writer_the_wait_and_returns_at_once(monkeypatch):
    handed = []
    monkeypatch.setattr(checkpointing, "schedule_async_save", handed.append)
    request = AsyncRequest(divmod, (17, 5), [])
    started = time.monotonic()
    with stalled_writes(0.3, asynchronous=True):
        checkpointing.schedule_async_save(request)
    assert time.monotonic() - started < 0.3  # the rank did not wait
    assert checkpointing.schedule_async_save == handed.append  # Megatron's own again after the save
    (late,) = handed
    assert late.async_fn_args == (17, 5) and late.finalize_fns == []
    # The writer process receives the request pickled, and waits before it writes.
    write = pickle.loads(pickle.dumps(late)).async_fn
    started = time.monotonic()
    assert write(*late.async_fn_args) == (3, 2)
    assert time.monotonic() - started >= 0.3


def test_a_synchronous_save_waits_in_the_rank_and_no_stall_changes_nothing(monkeypatch):
    handed = []
    monkeypatch.setattr(checkpointing, "schedule_async_save", handed.append)
    started = time.monotonic()
    with stalled_writes(0.3, asynchronous=False):
        waited = time.monotonic() - started
    assert waited >= 0.3
    with stalled_writes(0.0, asynchronous=True):
        checkpointing.schedule_async_save(AsyncRequest(divmod, (17, 5), []))
    assert handed[0].async_fn is divmod


def test_a_stall_strikes_the_first_save_at_or_after_its_iteration_once():
    events = _Events()
    faults = InjectedFaults([parse_fault("stall:rank=2,at=4,seconds=30"), parse_fault("stall:rank=3,at=1,seconds=9")],
                            2, events, lambda: "rank 2")
    assert faults.stall_in_save(2) == 0.0
    faults.forget_before(3)  # a recovery before the stall struck keeps it
    faults.at_start(4, None, None)  # an iteration's start strikes nothing
    assert faults.stall_in_save(6) == 30.0
    assert faults.stall_in_save(8) == 0.0
    assert [(e, i, f["fault"]) for e, i, f in events.emitted] == [("inject", 6, "stall:rank=2,at=4,seconds=30")]
