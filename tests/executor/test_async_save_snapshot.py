"""An asynchronous ``torch_dist`` save on a CPU holds the values its tensors had when it was scheduled.

megatron-core's writer process takes a save's tensors through a preload that, on a GPU, copies them
to the host; the rank waits for it and trains on. On a CPU that copy returned the tensors
themselves, so a step after the save changed what the writer then wrote. The case runs in a
one-rank gloo world of its own process, with megatron-core's persistent writer forked from it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

from scripts.child_env import job_env  # noqa: E402
from tests.dist.launch import REPO  # noqa: E402

SAVE = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist

    root = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    from megatron.resihp import cpu_training
    cpu_training.enable()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.resihp.async_saves import write_results_queue
    write_results_queue("fork")  # a -c script cannot be spawned from
    with cpu_training._one_device():  # forked with one device, as the loop starts it
        AsyncCallsQueue.warmup_persistent_caller(0, "fork")
    weight = torch.arange(2**20, dtype=torch.float32).reshape(1024, 1024)
    os.makedirs(f"{root}/ckpt")
    request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)},
                                      f"{root}/ckpt", async_sharded_save=True, async_strategy="mcore")
    calls = AsyncCallsQueue(persistent=True)
    calls.schedule_async_request(request)
    weight.add_(1.0)  # the next step, in place, while the writer writes
    calls.maybe_finalize_async_calls(blocking=True, no_dist=True)
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1024, 1024), replica_id=0)}
    loaded = dist_checkpointing.load(template, f"{root}/ckpt")["w"]
    scheduled = torch.arange(2**20, dtype=torch.float32).reshape(1024, 1024)
    print(f"as_scheduled={torch.equal(loaded, scheduled)}")
    calls.close()
    dist.destroy_process_group()
""")


def saved(tmp_path) -> str:
    proc = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path)], cwd=REPO, env=job_env(None),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_an_asynchronous_save_on_a_cpu_holds_its_tensors_as_they_were_when_scheduled(tmp_path):
    assert saved(tmp_path) == "as_scheduled=True"
