"""A rank forked from a fork server counts its time (``--exit-duration-in-mins``, Megatron's "time to
initialize megatron") from its own start, not from when the server imported Megatron's training
package."""

from __future__ import annotations

import json
import os
import time

import pytest

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")


def test_a_forked_rank_counts_from_its_fork_not_from_the_servers_import():
    from megatron.resihp import gpt_pretrain  # what a fork server imports once
    from megatron.training import training

    imported_at = training._TRAIN_START_TIME
    time.sleep(max(0.0, imported_at + 1.0 - time.time()))  # the server waits a while for a launch
    forked_at = time.time()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank
        try:
            gpt_pretrain.count_time_from_process_start()
            os.write(write, json.dumps([training._TRAIN_START_TIME, training._LEGACY_TRAIN_START_TIME]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as said:
        start, legacy_start = json.loads(said.read())
    os.waitpid(pid, 0)
    # The kernel keeps a process's start in clock ticks (10 ms).
    assert start == legacy_start and forked_at - 0.05 <= start <= time.time(), (imported_at, forked_at, start)
    assert start - imported_at >= 0.9, (imported_at, start)
