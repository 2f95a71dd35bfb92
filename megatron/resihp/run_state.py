"""What a running job is, as one value: ``RunState``.

Responsible for naming everything an in-place adaptation replaces: the Layout and the process
groups built for it, this process's identity in the current world (its rank there, its launch
rank, every rank's launch rank), the world's generation (the store prefix no earlier world used),
the micro-batch quotas, and the training objects (model chunks, optimizer, LR scheduler) built on
those groups. It is frozen: a layout change (``reconfigure.apply``) builds a new one and returns
it, so the state a change started from stays whole until the change commits, and going back is
keeping the old value. The data iterators are built per iteration by the loop from the sampler
and ``replica`` / ``quotas``, so they hold nothing a change must carry.

Nothing about the run is written onto the argparse Namespace after start-up: ``args`` holds the
flags, this holds the run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from resihp_ext.layout import Layout


class StopTraining(Exception):
    """Raised when this process leaves the job (spare, or checkpoint fallback)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def leave_process(exit_code: int) -> NoReturn:
    """End this process now with ``exit_code``, its output flushed, without the interpreter's
    teardown: a rank leaves a job whose peers or store are gone, and torch's C++ threads still
    blocked on them can abort that teardown (``terminate called without an active exception``),
    turning the exit code the launcher reports into 134."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


@dataclasses.dataclass(frozen=True)
class RunState:
    """One process's view of the running job.

    Attributes:
        layout: the placement, in ranks of the current world.
        groups: this rank's ``ParallelGroups`` for ``layout`` (installed), or None where none exist.
        messages: the gloo group detection's messages travel on in this world (None: the world
            group is gloo); one per world, made by the group builder when the world forms.
        rank: this process's rank in the current world.
        launch_rank: its rank at launch (kept across worlds; standbys are named by it).
        identity: launch rank of every rank of the current world, by rank.
        generation: the world's number; a new world takes a number no earlier one used.
        objects: model chunks (DDP), optimizer and LR scheduler built on ``groups`` (None on a
            process that holds no state, such as a standby).
        quotas: micro-batches per replica.
        sync: the layer-wise gradient sync when replicas differ (None: megatron-core's DDP syncs).
        part_copies: under Megatron's distributed optimizer with resilience on, this rank's update
            count and the copy it keeps of another rank's part (``optimizer_parts.PartCopies``,
            made anew for every world); None otherwise.
    """

    layout: Layout
    groups: object | None
    rank: int
    launch_rank: int
    identity: tuple[int, ...]
    generation: int
    objects: object | None
    quotas: tuple[int, ...]
    messages: object | None = None
    sync: object | None = None
    part_copies: object | None = None

    @property
    def replica(self) -> int:
        """This rank's replica index in ``layout`` (its data-parallel rank)."""
        return self.layout.stage_of(self.rank)[0]

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank_of(self.rank)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.num_replicas

    @property
    def world_size(self) -> int:
        return len(self.identity)

    def renumbered(self, new_rank: Mapping[int, int]) -> tuple[int, ...]:
        """``identity`` after this world's ranks became ``new_rank[old]`` (ranks it lacks left)."""
        return tuple(self.identity[old] for old in sorted(new_rank, key=new_rank.get))

    def replace(self, **changes) -> "RunState":
        return dataclasses.replace(self, **changes)
