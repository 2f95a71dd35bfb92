"""Run output: Megatron's iteration line, TensorBoard scalars, and the JSONL event log.

Responsible for formatting and writing; it computes nothing about training itself. The event
log is shared by all ranks of a job: each event is one ``os.write`` of one line to a file opened
with O_APPEND, so lines from different processes never interleave.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any, NoReturn


def exit_with_error(message: str) -> NoReturn:
    """Refuse a setting before the job does anything: ``error: MESSAGE`` on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class EventLog:
    """JSONL events: every object has ``event``, ``iteration``, ``time`` (unix s) and ``rank``."""

    def __init__(self, path: str | None, rank: int):
        self.rank = rank
        self._fd = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, iteration: int, **fields: Any) -> None:
        if self._fd is None:
            return
        # The pid lets an operator (or a fault test) signal the process of a rank from outside.
        record = {"event": event, "iteration": iteration, "time": time.time(), "rank": self.rank,
                  "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record, default=_jsonable) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def process_threads() -> dict[str, int]:
    """This process's threads by name, as the kernel lists them (``/proc/self/task``; empty where
    there is none). Recorded as a job starts and finishes, so that threads a re-formed world should
    have released (gloo's, a data loader's) show up when they are not."""
    counts: dict[str, int] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return counts
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                name = comm.read().strip()
        except OSError:  # ended since the listing
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def log_line(message: str) -> None:
    """A timestamped line on stdout, flushed (Megatron's print_rank_last style)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)


def iteration_line(
    *, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float, lr: float,
    global_batch_size: int, lm_loss: float, grad_norm: float | None, tokens_per_s: float,
    skipped: int, nan: int, loss_scale: float = 1.0,
) -> str:
    """Megatron's iteration line; like Megatron's, ``lm_loss`` is the mean over the iterations since
    the last line (finite ones), and ``skipped`` and ``nan`` count them."""
    norm = "nan" if grad_norm is None else f"{grad_norm:.3f}"
    return (
        f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {lr:.6E} |"
        f" global batch size: {global_batch_size:5d} | lm loss: {lm_loss:.6E} | loss scale: {loss_scale:.1f} |"
        f" grad norm: {norm} |"
        f" tokens per second: {tokens_per_s:.1f} | number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nan:3d} |"
    )


class TensorBoard:
    """Scalars to --tensorboard-dir when tensorboard is installed; a warning otherwise."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if not log_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("WARNING: --tensorboard-dir given but tensorboard is not installed "
                  "(pip install tensorboard); skipping TensorBoard output", file=sys.stderr)
            return
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# Users name ranks by launch rank (what they started, and killed); after a re-form the world
# numbers its members afresh. Every line about a failure, a verdict, a plan, a spare or an exit
# therefore names launch ranks, adding the current world's number only where it differs.
# ``identity`` is ``RunState.identity``: the launch rank of every rank of the current world.
# Worlds up to this size spell out their whole numbering after a text in world ranks.
_MAX_MAPPED_WORLD = 64


def _launch_order(identity) -> bool:
    return identity is None or all(launch == rank for rank, launch in enumerate(identity))


def rank_name(rank: int, identity, new_rank: int | None = None) -> str:
    """``launch rank L``, with ``(world rank W)`` where the current world numbers it W != L, or
    ``(world rank W -> N)`` when it moves to ``new_rank`` in the next world."""
    if identity is not None and not 0 <= rank < len(identity):
        return f"world rank {rank}"
    launch = rank if identity is None else identity[rank]
    if new_rank is not None and new_rank != rank:
        return f"launch rank {launch} (world rank {rank} -> {new_rank})"
    return f"launch rank {launch}" if launch == rank else f"launch rank {launch} (world rank {rank})"


def ranks_name(ranks, identity) -> str:
    """``launch ranks [..]`` in world-rank order, with ``(world ranks [..])`` where they differ."""
    world = sorted(ranks)
    if identity is not None and any(not 0 <= r < len(identity) for r in world):
        return f"world ranks {world}"
    launch = world if identity is None else [identity[r] for r in world]
    return f"launch ranks {launch}" if launch == world else f"launch ranks {launch} (world ranks {world})"


def world_numbered(text: str, identity) -> str:
    """``text`` written in the current world's ranks (a pure decision's reason), marked as such
    where that world's numbers are not launch ranks, with the numbering when the world is small."""
    if _launch_order(identity):
        return text
    if len(identity) <= _MAX_MAPPED_WORLD:
        return f"{text} [in world ranks; world ranks 0.. are launch ranks {list(identity)}]"
    return f"{text} [in world ranks]"
