"""Runs a function on real gloo ranks (spawned processes) for the tests of groups and messages.

One TCPStore is hosted by the test process so that it outlives any rank; ranks fork from a server
that imported torch and megatron-core once.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resihp_ext.layout import ModelSpec

TINY = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
                 seq_length=16, micro_batch_size=2, global_batch_size=8)
GROUP_TIMEOUT_S = 30.0


_PRELOAD = ["torch", "torch.distributed", "megatron.core.models.gpt", "megatron.core.distributed",
            "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.resihp.cpu_mode",
            "megatron.resihp.parallel_state_patch"]


def _entry(fn, rank, world_size, port, results, args, world_timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from megatron.resihp import cpu_mode

        cpu_mode.enable()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore("resihp/gen0/", store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=world_timeout_s))
        results.put((rank, "ok", fn(rank, world_size, store, *args)))
    except BaseException:  # report everything: a silent rank would only show up as a timeout
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, kill_rank: int | None = None, timeout_s: float = 90.0,
              world_timeout_s: float = GROUP_TIMEOUT_S) -> dict:
    """Run ``fn(rank, world_size, store, *args)`` on ``world_size`` spawned gloo ranks.

    With ``kill_rank``, that rank is SIGKILLed once it sets the store key ``kill_me``; then the key
    ``killed`` is set for the survivors. ``world_timeout_s`` is the default group's collective
    timeout. Returns ``{rank: result}``; raises on any rank's error.
    """
    # One forkserver imports torch and megatron-core once; each rank is forked from it in
    # milliseconds instead of importing them again (seconds per rank on two cores).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, fn.__module__])  # the rank functions' module too
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store.port, results, args, world_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out, errors = {}, {}
    expected = world_size - (kill_rank is not None)
    try:
        if kill_rank is not None:
            store.wait(["kill_me"], datetime.timedelta(seconds=timeout_s))
            os.kill(procs[kill_rank].pid, signal.SIGKILL)
            procs[kill_rank].join(10)
            store.set("killed", "1")
        while len(out) + len(errors) < expected:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out) - set(errors))} "
                                     f"did not finish in {timeout_s} s") from None
            (out if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
    return out
