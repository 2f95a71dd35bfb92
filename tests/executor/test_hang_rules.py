"""The rank the others wait for: what a training thread is doing, and who holds the job up."""

import datetime
import io
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron.resihp.hang_rules import (IO, WAITING, WORKING, blocking_after_s, judge_blocking,
                                           main_thread_state)


def state_while(block, release) -> str:
    """The main thread's state, read from another thread while the main thread runs ``block()``
    (which returns once ``release()`` is called)."""
    seen = []

    def watch():
        time.sleep(0.3)
        seen.append(main_thread_state())
        release()

    watcher = threading.Thread(target=watch)
    watcher.start()
    block()
    watcher.join()
    return seen[0]


def test_a_thread_waiting_in_torch_distributed_is_waiting():
    store = dist.HashStore()
    key = f"{distributed_c10d.STORE_BASED_BARRIER_PREFIX}:g"

    def release():
        store.add(key, 1)
        store.set(f"{key}:last_worker", "1")

    state = state_while(lambda: distributed_c10d._store_based_barrier(0, store, "g", 2, datetime.timedelta(seconds=20)),
                        release)
    assert state == WAITING


def test_a_thread_writing_a_checkpoint_is_in_io_and_one_stuck_in_its_own_code_is_working():
    gate = threading.Event()

    class SlowFile(io.BytesIO):
        def write(self, data):
            gate.wait()
            return super().write(data)

    assert state_while(lambda: torch.save({"w": torch.zeros(4)}, SlowFile()), gate.set) == IO
    stuck = threading.Event()
    assert state_while(stuck.wait, stuck.set) == WORKING


def test_a_rank_working_without_progress_while_another_waits_is_named():
    # Rank 2 has worked since t=0 without progress; ranks 0 and 1 wait in a collective since t=1.
    progress = {0: 0.0, 1: 0.0, 2: 0.0}
    states = {0: (WAITING, 1.0), 1: (WAITING, 1.0), 2: (WORKING, 0.0)}
    assert judge_blocking(11.0, progress, states, 10.0) == {2}
    assert judge_blocking(10.5, progress, states, 10.0) == frozenset()  # nobody waited 10 s yet
    # A rank writing a checkpoint while others wait in the save's barrier is never named.
    assert judge_blocking(11.0, progress, {**states, 2: (IO, 0.0)}, 10.0) == frozenset()
    # Nobody waits: every rank computes (a long step, an evaluation), so nobody is held up.
    assert judge_blocking(30.0, progress, {r: (WORKING, 0.0) for r in progress}, 10.0) == frozenset()
    # Progress since: a slow rank that finishes iterations is not hung.
    assert judge_blocking(11.0, {**progress, 2: 5.0}, states, 10.0) == frozenset()
    # A rank whose state flickered into a wait less than 10 s ago has not worked 10 s on end.
    assert judge_blocking(11.0, progress, {**states, 2: (WORKING, 4.0)}, 10.0) == frozenset()


def test_how_long_a_rank_may_work_while_others_wait_follows_its_iterations():
    assert blocking_after_s([0.3, 0.4], 10, 7.5) is None  # too few iterations timed in this world
    assert blocking_after_s([0.3, 0.4, 0.3], 10, 7.5) == 7.5  # the floor
    assert blocking_after_s([2.0, 2.5, 1.0, 3.0], 10, 7.5) == pytest.approx(22.5)
    assert blocking_after_s([2.0, 2.5, 1.0], 0, 7.5) is None  # off
