"""Checkpoints: save and resume iteration, consumed samples, model, optimizer, scheduler and RNG.

Layout on disk (Megatron's legacy layout):
    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt   written by DP rank 0 of each (TP, PP)
    SAVE/iter_0000010/rng/rank_RRRRR.pt                   every rank's RNG states
    SAVE/iter_0000010/metadata.json                        shape of the run that wrote it

Atomicity: every file goes to ``iter_X.tmp/`` first; after a barrier, rank 0 renames the folder
to ``iter_X`` and only then replaces the tracker file (write temp + ``os.replace``). A crash
mid-save leaves at most a ``.tmp`` folder (or an ``iter_X`` the tracker does not name) that no
load ever reads; the next complete save removes the ``.tmp`` folders of interrupted ones. What the
survivors of a rank lost during a save do is ``resilient_save``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron.resihp.parallel_state_patch import installed

TRACKER = "latest_checkpointed_iteration.txt"


def _no_fault(phase: str) -> None:
    """Default of ``at_phase``: a save with no fault aimed at its phases."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _shard_name() -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return f"mp_rank_{tp:02d}_{pp:03d}"


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _metadata(args: argparse.Namespace) -> dict:
    # The shape of replica 0, which writes the shards (after a re-plan it may differ from the flags).
    layout = installed().layout if installed() is not None else None
    replica = layout.replicas[0] if layout is not None else None
    return {
        "tensor_model_parallel_size": replica.stages[0].tp_degree if replica else args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "layers_per_stage": list(replica.layers_per_stage if replica else args.layers_per_stage),
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
    }


def save_checkpoint(args: argparse.Namespace, iteration: int, consumed_samples: int, objects,
                    at_phase: Callable[[str], None] = _no_fault) -> str:
    """Collective: every rank calls it. Returns the final checkpoint folder.

    Args:
        at_phase: called with each phase of the save this rank reaches (``save``, ``save-write``,
            ``save-rename``, ``save-tracker``: ``resihp_ext.faults.SAVE_PHASES``), where a fault
            injected into that phase strikes.
    """
    at_phase("save")
    final = _iter_dir(args.save, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    # Replica 0 writes the shards (after a heterogeneous re-plan DP groups no longer span replicas).
    groups = installed()
    if (groups.replica if groups is not None else parallel_state.get_data_parallel_rank()) == 0:
        shard = os.path.join(tmp, _shard_name())
        os.makedirs(shard, exist_ok=True)
        torch.save(
            {
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "model": objects.model.state_dict(),
                "optimizer": objects.optimizer.state_dict(),
                "scheduler": objects.scheduler.state_dict(),
            },
            os.path.join(shard, "model_optim_rng.pt"),
        )
    at_phase("save-write")  # this rank's shard is written, its RNG file not yet
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{dist.get_rank():05d}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        finalize_checkpoint(args, args.save, tmp, final, iteration, consumed_samples, at_phase)
    else:  # the rename and the tracker happen on rank 0 alone, while the others wait below
        at_phase("save-rename")
        at_phase("save-tracker")
    dist.barrier()
    return final


def finalize_checkpoint(args: argparse.Namespace, root: str, tmp: str, final: str, iteration: int,
                        consumed_samples: int, at_phase: Callable[[str], None] = _no_fault) -> None:
    """One rank, after every shard is in ``tmp``: metadata, rename, then the tracker file; then the
    ``.tmp`` folders of interrupted saves go."""
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump({"iteration": iteration, "consumed_samples": consumed_samples, **_metadata(args)}, f)
    at_phase("save-rename")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    at_phase("save-tracker")  # renamed, but the tracker still names the previous checkpoint
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _remove_interrupted(root)


def _remove_interrupted(root: str) -> None:
    """Delete the ``iter_N.tmp`` folders left by saves that never completed: one save runs at a
    time in a job, so once this one is complete, no other is being written."""
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def load_checkpoint(args: argparse.Namespace, objects) -> tuple[int, int]:
    """Restore from ``--load``; returns (iteration, consumed_samples), (0, 0) when there is none."""
    iteration = latest_iteration(args.load) if args.load else None
    if iteration is None:
        return 0, 0
    folder = _iter_dir(args.load, iteration)
    with open(os.path.join(folder, "metadata.json")) as f:
        meta = json.load(f)
    mismatched = {k: (v, _metadata(args)[k]) for k, v in meta.items() if k in _metadata(args) and v != _metadata(args)[k]}
    if mismatched:
        raise ValueError(
            f"--load {args.load}: checkpoint at iteration {iteration} was written with {mismatched} "
            "(saved, requested); relaunch with the saved parallel shape"
        )
    state = torch.load(os.path.join(folder, _shard_name(), "model_optim_rng.pt"), weights_only=False)
    objects.model.load_state_dict(state["model"])
    if not args.no_load_optim:
        objects.optimizer.load_state_dict(state["optimizer"])
        objects.scheduler.load_state_dict(state["scheduler"])
    rng_path = os.path.join(folder, "rng", f"rank_{dist.get_rank():05d}.pt")
    if not args.no_load_rng and os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return state["iteration"], state["consumed_samples"]
