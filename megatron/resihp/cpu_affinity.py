"""A CPU rank runs on a core of its own when the host has one for every rank.

In CPU mode a rank stands for a device, and its core is that device. Left to the scheduler, a
rank moves between cores, and on a virtual machine each vCPU drifts in speed on its own (some %
for tens of seconds; ``docs/notes/benchmarks.md`` section 20), so the rank's op times mix the drifts of
two cores and the detector's per-group speed level (``resihp_ext/detection/speed_level.py``) follows neither.
Pinned, a rank sees one core's drift. Measured on this project's 2-core host (TP1 x PP2, hidden
256, 100 iterations, two runs each, ``docs/notes/benchmarks.md`` section 21): micro-batch predictor
error 1.92% and 2.06% pinned, 2.08% and 2.33% not.

When ranks outnumber cores (8 ranks on 2 in CI) nothing is pinned: the scheduler balances ranks
that wait in pipeline bubbles better than a fixed assignment would. ``RESIHP_CPU_PIN=0`` turns
pinning off, ``=1`` pins even then. It never changes numerics.
"""

from __future__ import annotations

import os

PIN_ENV = "RESIHP_CPU_PIN"


def core_for_rank(local_rank: int, local_world_size: int, cpus: list[int], setting: str | None) -> int | None:
    """The core a rank should run on, or None to leave it to the scheduler.

    Args:
        local_rank: the rank's index on this host.
        local_world_size: ranks on this host.
        cpus: the cores this process may run on, sorted.
        setting: the value of ``RESIHP_CPU_PIN`` (None: pin when every rank has a core).
    """
    if setting not in (None, "", "0", "1"):
        raise ValueError(f"{PIN_ENV} must be 0 (never pin), 1 (always pin) or unset (pin when every rank "
                         f"has a core of its own), got {setting!r}")
    if setting == "0" or not cpus:
        return None
    if setting != "1" and local_world_size > len(cpus):
        return None
    return cpus[local_rank % len(cpus)]


def pin_this_rank() -> int | None:
    """Pin the calling thread (and the threads it starts later) per ``core_for_rank``; returns the
    core, or None. Call before the process group starts its threads."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = core_for_rank(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         sorted(os.sched_getaffinity(0)), os.environ.get(PIN_ENV))
    if core is not None:
        os.sched_setaffinity(0, {core})
    return core
