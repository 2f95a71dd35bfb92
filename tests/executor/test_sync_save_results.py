"""A synchronous ``torch_dist`` save starts no process, and writes what it wrote before.

Each case saves and loads a sharded tensor with megatron-core's ``dist_checkpointing`` in a
one-rank gloo world of its own process (the patch and the world are process-wide state).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

from scripts.child_env import job_env  # noqa: E402
from tests.dist.launch import REPO  # noqa: E402

SAVE = textwrap.dedent("""
    import multiprocessing, os, sys
    import torch, torch.distributed as dist

    root, patched = sys.argv[1], sys.argv[2] == "patched"
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    from megatron.resihp import cpu_training
    cpu_training.enable()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    if patched:
        import argparse
        from megatron.resihp import sync_save_results
        sync_save_results.install(argparse.Namespace(async_save=False))
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    os.makedirs(f"{root}/ckpt")
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}, f"{root}/ckpt")
    children = len(multiprocessing.active_children())
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)}
    loaded = dist_checkpointing.load(template, f"{root}/ckpt")["w"]
    print(f"children={children} equal={torch.equal(loaded, weight)}")
    dist.destroy_process_group()
""")


def saved(tmp_path, mode: str) -> str:
    root = tmp_path / mode
    root.mkdir()
    proc = subprocess.run([sys.executable, "-c", SAVE, str(root), mode], cwd=REPO, env=job_env(None),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_synchronous_save_keeps_its_results_in_the_process_and_loads_back_the_same(tmp_path):
    # megatron-core's own path starts a Manager process for the results (the cost this removes).
    assert saved(tmp_path, "stock") == "children=1 equal=True"
    assert saved(tmp_path, "patched") == "children=0 equal=True"


def test_with_async_save_megatron_cores_results_queue_stays():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron.resihp import sync_save_results

    own = filesystem_async.get_write_results_queue
    sync_save_results.install(argparse.Namespace(async_save=True))
    try:
        assert filesystem_async.get_write_results_queue is own
    finally:
        sync_save_results.uninstall()


@pytest.mark.parametrize("async_save", [False, True])
def test_resilience_leaves_a_synchronous_save_its_in_process_queue(async_save):
    # The loop's patch for asynchronous saves (a results queue whose process dies with its rank)
    # goes in after this one and must hand synchronous saves back to it.
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import global_vars

    from megatron.resihp import sync_save_results
    from megatron.resihp.async_saves import AsyncSaves

    args = argparse.Namespace(async_save=async_save)
    before, served = global_vars._GLOBAL_ARGS, filesystem_async._results_queue
    sync_save_results.install(args)
    saves = AsyncSaves(loop=None)
    saves.install()
    global_vars.set_args(args)
    try:
        results = filesystem_async.get_write_results_queue("fork")
        assert isinstance(results, queue.Queue) != async_save, type(results)
    finally:
        saves.uninstall()
        sync_save_results.uninstall()
        global_vars.set_args(before)
        filesystem_async._results_queue = served
