"""A rank compiling a ``torch.compile`` graph is working, not hung.

``compile_watch`` sees Dynamo's compiles and a lazy backward's; a heartbeat monitor waits out a
compile that lasts past the hang timeout and starts the rank's stall clock again when it ends, so a
rank that then stays still is named a hang timeout later; a compile past the compile timeout is a hang.
Real torch.compile with a backend of the test's own (a compile as long as the test needs, no C
compiler), real monitors on a real TCPStore.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from megatron.resihp import compile_watch
from megatron.resihp.heartbeat import HeartbeatMonitor, connect_store

HANG_TIMEOUT_S = 0.8
COMPILE_S = 2.5


def test_the_watch_sees_a_frame_compiled_and_a_backward_compiled_at_its_first_run():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            seen.append((kind, compile_watch.compiling()))
            return make_boxed_func(gm.forward)
        return compile_graph

    torch._dynamo.reset()  # which drops every compile callback: the watch registers anew
    assert compile_watch.install()
    fn = torch.compile(lambda x: (x.sin() * 3).sum(),
                       backend=aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")))
    x = torch.randn(8, requires_grad=True)
    loss = fn(x)
    assert not compile_watch.compiling()
    assert ("forward", True) in seen and not any(kind == "backward" for kind, _ in seen), seen
    loss.backward()  # the backward graph compiles now
    assert ("backward", True) in seen, seen
    assert not compile_watch.compiling()


def compile_slowly(seconds: float) -> tuple[float, float]:
    """Compile a function on this thread with a backend that takes ``seconds``; its start and end."""
    span = []

    def slow_backend(gm, example_inputs):
        span.append(time.time())
        time.sleep(seconds)
        span.append(time.time())
        return gm.forward

    torch.compile(lambda x: x.cos() + 1, backend=slow_backend)(torch.randn(4))
    return span[0], span[1]


@pytest.fixture
def watched_pair():
    """Two monitors of one job: rank 0 in its recovery (as a survivor waiting on rank 1 would be),
    rank 1 standing still at its last progress, compiling on this process's main thread."""
    torch._dynamo.reset()  # a fresh compile; the monitors register the watch's callbacks anew
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monitors, named = [], []

    def start(compile_timeout_s: float) -> HeartbeatMonitor:
        for rank in (0, 1):
            mon = HeartbeatMonitor(connect_store("127.0.0.1", master.port), rank, 2, interval_s=0.05, timeout_s=0.3,
                                   hang_timeout_s=HANG_TIMEOUT_S, compile_timeout_s=compile_timeout_s,
                                   on_hang=lambda ranks, now, rank=rank: named.append((rank, sorted(ranks), now)))
            mon.beat(3)
            monitors.append(mon.start())
        monitors[0].mark_recovering()
        return monitors[0]

    yield start, named
    for mon in monitors:
        mon.stop()


def test_a_compile_past_the_hang_timeout_is_no_hang_and_the_stall_clock_starts_when_it_ends(watched_pair, caplog):
    start, named = watched_pair
    watcher = start(compile_timeout_s=60.0)
    seen_compiling = []
    probe = threading.Timer(1.0, lambda: seen_compiling.append(watcher.compiling_ranks))
    probe.start()
    with caplog.at_level(logging.WARNING, logger="megatron.resihp.heartbeat"):
        began, ended = compile_slowly(COMPILE_S)
        deadline = time.time() + 10
        while not named and time.time() < deadline:
            time.sleep(0.05)
    probe.join()
    assert seen_compiling == [frozenset({1})]
    assert named, "rank 1, still after its compile, was never named hung"
    by, ranks, at = named[0]
    assert (by, ranks) == (0, [1])
    # Not during the compile, nor the moment it ended: a full hang timeout after.
    assert at >= ended + HANG_TIMEOUT_S, (began, ended, at)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "launch rank 1 has compiled a torch.compile graph for" in said and "--resihp-compile-timeout-s (60 s)" in said, said
    assert "[1]: no progress for" in said, said


def test_a_compile_past_the_compile_timeout_is_a_hang(watched_pair, caplog):
    start, named = watched_pair
    started = time.time()
    start(compile_timeout_s=1.5)
    with caplog.at_level(logging.WARNING, logger="megatron.resihp.heartbeat"):
        began, ended = compile_slowly(COMPILE_S)
    assert named and named[0][:2] == (0, [1]), named
    # During the compile, and only once it outlasted the compile timeout (the hang timeout is 0.8 s).
    assert started + 1.5 <= named[0][2] < ended, (started, began, ended, named)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "[1]: compiling for over 1.5 s (--resihp-compile-timeout-s)" in said, said
