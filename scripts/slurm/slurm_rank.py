#!/usr/bin/env python
"""One Slurm task becomes one training rank: Slurm's environment in, torchrun's environment out.

Responsible for: reading the task's place in the job step from Slurm (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE``), writing the
same variables ``scripts/launch_local.py`` gives its workers (``rank_vars``: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``,
...), and replacing itself with ``python -u SCRIPT ARGS`` (``exec``: the task's pid is the rank's,
so Slurm's signals and ``scontrol listpids`` reach the rank itself).

So a rank under Slurm starts exactly as under the local launcher: env:// initialisation as a
client of a store that no rank hosts, heartbeats through the same store. It must never host the
store or start other ranks; ``pretrain_resilient.sbatch`` hosts the store (``job_store.py``).

Usage (as the command of an ``srun`` step; ``MASTER_ADDR`` and ``MASTER_PORT`` set by the caller)::

    srun --kill-on-bad-exit=0 python scripts/slurm/slurm_rank.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import re
import sys
from typing import Mapping

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from launch_local import LAUNCHER_ENV, rank_vars  # noqa: E402  (scripts/ is not a package)

LAUNCHER_NAME = "slurm"
_REQUIRED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
             "MASTER_ADDR", "MASTER_PORT")


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts per node, e.g. ``"4(x2),3"`` -> ``[4, 4, 3]``.

    Args:
        spec: the value of ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``).

    Returns:
        The number of tasks on each node of the step, in node order.
    """
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: expected counts like '4(x2),3'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def rank_env(slurm: Mapping[str, str]) -> dict[str, str]:
    """The training rank's environment for a Slurm task.

    Args:
        slurm: the task's environment (``os.environ``): Slurm's step variables plus the job's
            ``MASTER_ADDR`` and ``MASTER_PORT``.

    Returns:
        ``slurm`` with the variables torchrun and ``launch_local.py`` give a worker, for this
        task's global rank, node and local rank.

    Raises:
        ValueError: a variable is missing or malformed (not started by ``srun``, or the batch
            script did not export the store's address).
    """
    missing = [name for name in _REQUIRED if not slurm.get(name)]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: start this under srun, with MASTER_ADDR and MASTER_PORT "
                         "exported (scripts/slurm/pretrain_resilient.sbatch does both)")
    try:
        rank, world_size = int(slurm["SLURM_PROCID"]), int(slurm["SLURM_NTASKS"])
        node, local_rank, port = int(slurm["SLURM_NODEID"]), int(slurm["SLURM_LOCALID"]), int(slurm["MASTER_PORT"])
    except ValueError as error:
        raise ValueError(f"a Slurm task variable or MASTER_PORT is not an integer ({error})") from None
    counts = tasks_per_node(slurm["SLURM_STEP_TASKS_PER_NODE"])
    if not 0 <= node < len(counts) or not 0 <= local_rank < counts[node] or not 0 <= rank < world_size:
        raise ValueError(f"task {rank} (node {node}, local {local_rank}) lies outside the step's layout "
                         f"{slurm['SLURM_STEP_TASKS_PER_NODE']!r} of {world_size} tasks")
    env = dict(slurm)
    env.update(rank_vars(rank, world_size, slurm["MASTER_ADDR"], port))
    # launch_local's variables are for one node; this task's place on its own node replaces them.
    env.update({
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(counts[node]),
        "GROUP_RANK": str(node),
        LAUNCHER_ENV: LAUNCHER_NAME,
    })
    return env


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2 if not argv else 0
    try:
        env = rank_env(os.environ)
    except ValueError as error:
        print(f"slurm_rank: error: {error}", file=sys.stderr)
        return 2
    if not os.path.isfile(argv[0]):
        print(f"slurm_rank: error: SCRIPT {argv[0]!r} is not a file; pass the training script's path "
              "(relative to the submit directory) after the sbatch file", file=sys.stderr)
        return 2
    os.execve(sys.executable, [sys.executable, "-u", *argv], env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
