"""The job-store keys through which standbys and the working ranks talk, and the rules for
reading them.

A standby writes its probe reports under ``report/<launch rank>`` and reads calls under
``call/<launch rank>``; its heartbeat beacon beats under ``beat/<launch rank>``; the working ranks
record whom they called into which world (``called/``), publish the job's iteration (``progress``)
and its end (``done``); a grown world's members say they are there under the world's prefix. A
report makes its standby ready only while its beacon says it lives and once it is back from the
latest call (``report_counts``).
"""

from __future__ import annotations

from megatron.resihp import heartbeat_beacon

PREFIX = "resihp/standby/"
DONE = PREFIX + "done"
PROGRESS = PREFIX + "progress"


def mark_job_done(store, launch_ranks) -> None:
    """Tell standbys the job has ended (finished, or saved for a restart): they exit 0.

    A standby stopped by a signal (its beacon marked it ``stopped``) cannot, and the launch
    (``launch_local.py``, ``srun``) would wait on it forever: it is evicted, and its beacon, a
    process of its own that no signal to the rank stops, SIGKILLs it on whatever host it runs.
    ``launch_ranks``: every rank of the launch, standbys among them."""
    store.set(DONE, "1")
    for launch_rank in launch_ranks:
        key = beat_key(launch_rank)
        if store.check([key]) and heartbeat_beacon.read_heartbeat(store.get(key))[2] == heartbeat_beacon.STOPPED_MARK:
            store.set(evicted_key(launch_rank), "1")


def report_key(launch_rank: int) -> str:
    return f"{PREFIX}report/{launch_rank}"


def call_key(launch_rank: int) -> str:
    return f"{PREFIX}call/{launch_rank}"


def called_key(launch_rank: int) -> str:
    return f"{PREFIX}called/{launch_rank}"


def go_key(generation: int) -> str:
    return f"{PREFIX}go/{generation}"


def here_key(generation: int, launch_rank: int) -> str:
    return f"resihp/gen{generation}/standby/{launch_rank}"


def joining_key(generation: int, new_rank: int) -> str:
    return f"resihp/gen{generation}/joining/{new_rank}"


def evicted_key(launch_rank: int) -> str:
    return beat_key(launch_rank) + "/evicted"


def beat_key(launch_rank: int) -> str:
    return f"{PREFIX}beat/{launch_rank}"


def beat_as_standby(launch_rank: int) -> None:
    """Point this process's heartbeat beacon (if it has one) at its standby key: the beacon marks it
    there the moment it dies or has stood stopped, so a recovery that calls it plans without it at
    once instead of waiting out the call."""
    beacon = heartbeat_beacon.current()
    if beacon is not None:
        # Evicted only when the job ends with this standby stopped by a signal (``mark_job_done``).
        beacon.point_at(beat_key(launch_rank), evicted_key(launch_rank))


def marked_gone(store, launch_rank: int) -> bool:
    """Whether the beacon of standby ``launch_rank`` said it died or stands stopped by a signal."""
    key = beat_key(launch_rank)
    return store.check([key]) and heartbeat_beacon.read_heartbeat(store.get(key))[2] in (
        heartbeat_beacon.DEAD_MARK, heartbeat_beacon.STOPPED_MARK)


def record_call(store, launch_rank: int, generation: int) -> None:
    """Note that standby ``launch_rank`` is being called into world ``generation`` (``report_counts``)."""
    store.set(called_key(launch_rank), str(generation))


def report_counts(store, launch_rank: int, report: dict) -> bool:
    """Whether standby ``launch_rank``'s latest ``report`` may make it ready: not while its beacon
    says it died or stands stopped, nor before it is back from the latest world it was called into
    (a report written between the check that planned the call and the call itself is older than
    the call; a joiner that died in a world that never formed sends no later one)."""
    called = int(store.get(called_key(launch_rank))) if store.check([called_key(launch_rank)]) else 0
    return report.get("back_from", 0) >= called and not marked_gone(store, launch_rank)
