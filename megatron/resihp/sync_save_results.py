"""A synchronous ``torch_dist`` save collects its writers' results in the saving process.

megatron-core 0.19.2's ``FileSystemWriterAsync`` hands the results of its writer threads back
through ``get_write_results_queue()``: a queue served by a ``multiprocessing`` Manager, started
with the *spawn* method the first time a process saves. That is needed when the writers run in
another process (``--async-save``); a synchronous save runs them as threads of the rank itself,
yet still pays for the Manager: a fresh interpreter per rank that imports torch to unpickle the
results. Eight ranks on a 2-core host spent 19.7 s in a save of a 4-layer model, 1.6-2.2 s with
the results kept in the process (the layer-move tests' stock job; ``scripts/bench/checkpoint_save.py``
measures both ways in one run). On a GPU node the same spawn runs once per rank at its first save.

``install(args)`` replaces that function with one that returns a plain ``queue.Queue`` when the
job saves synchronously; with ``--async-save`` megatron-core's own stays. Nothing a save writes
changes, nor the errors it reports (a writer's exception travels through the queue either way).
Checked against megatron-core 0.19.2, the version ``training_compat`` (imported beside it by
``gpt_pretrain``) insists on.
"""

from __future__ import annotations

import argparse
import queue

_undo: list = []


def _in_process_queue(mp_mode: str = "spawn") -> queue.Queue:
    del mp_mode  # the writers are threads of this process
    return queue.Queue()


def install(args: argparse.Namespace) -> None:
    """Keep synchronous saves' results in the process (idempotent; nothing with ``--async-save``)."""
    if _undo or getattr(args, "async_save", False):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue
    filesystem_async.get_write_results_queue = _in_process_queue
    _undo.append(lambda: setattr(filesystem_async, "get_write_results_queue", original))


def uninstall() -> None:
    """Undo ``install()``."""
    while _undo:
        _undo.pop()()
