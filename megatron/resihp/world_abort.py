"""Abandoning a failed world's collectives at once instead of waiting out their timeout.

Responsible for: making every collective of this process's current world (the default group and
every subgroup) fail now, so that ranks blocked in one with this rank leave it within
milliseconds and reach recovery. Called as a rank's recovery starts (its own collective failed),
and from the heartbeat thread for failures that break no connection by themselves.

* **gloo** offers no way to interrupt a collective in flight (``ProcessGroupGloo.abort()`` returns
  but leaves the blocked call waiting: measured with torch 2.13). What a dead peer does to its
  direct neighbours, closing its sockets, is what makes a blocked gloo call raise ("Connection
  closed by peer"). So this shuts down, from this side, every connected TCP socket of the process
  except the job store's connections: the store carries the heartbeats and the rendezvous of the
  next world. Listening sockets are left alone (gloo's listener treats a shut-down listener as a
  fatal error and aborts the process). A survivor that shuts its sockets makes its own peers'
  collectives raise too, so the news travels even to ranks whose monitor has not polled yet.
* **NCCL**: ``torch.distributed``'s process-group abort, which ends the communicators' pending
  work; the NCCL watchdog is kept from tearing the survivor down by the environment the launch
  scripts set (``TORCH_NCCL_ASYNC_ERROR_HANDLING``; see docs/launching.md). Written, not yet run
  on GPUs.

A dead rank's connections close at once only if no other process holds them: a process forked from
a rank (Megatron's data-loader workers, ``--num-workers``, 2 by default) inherits copies of its
sockets and keeps them open until it notices its parent is gone, which torch's workers check every
5 s. Measured on TP1 x PP2 x DP2, the last stage (which loads the labels) SIGKILLed: its peers' next
read failed 5 s after the kill. ``forget_rank_sockets`` makes such workers close their copies as
they start.

Nothing here decides that a world has failed; the caller does.
"""

from __future__ import annotations

import functools
import os
import socket

import torch.distributed as dist


def _tcp_sockets() -> list[socket.socket]:
    """This process's open TCP sockets, wrapped without taking ownership of their descriptors."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed since the listing, or not a socket after all
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            found.append(sock)
        else:
            sock.detach()
    return found


def shut_world_sockets(keep_ports: set[int]) -> int:
    """Shut down every connected TCP socket whose local or remote port is not in ``keep_ports``.

    Args:
        keep_ports: ports of the connections that must survive (the job store's).

    Returns:
        How many sockets were shut down.
    """
    count = 0
    for sock in _tcp_sockets():
        try:
            try:
                peer = sock.getpeername()
            except OSError:  # a listener, or a connection still being made
                continue
            if peer[1] in keep_ports or sock.getsockname()[1] in keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass  # the peer closed it first: already what this is for
        finally:
            sock.detach()  # the descriptor stays gloo's to close
    return count


def close_inherited_sockets() -> None:
    """In a process forked from a rank: close this process's copies of the rank's TCP connections
    (the rank's own stay open)."""
    for sock in _tcp_sockets():
        sock.close()


def _start_worker(chained, worker_id: int) -> None:
    close_inherited_sockets()
    if chained is not None:
        chained(worker_id)


def forget_rank_sockets(loader):
    """``loader`` (a ``torch.utils.data.DataLoader``, or None) with workers that close their copies
    of the rank's connections as they start, so that the rank's death closes them."""
    if loader is not None and loader.num_workers > 0:
        loader.worker_init_fn = functools.partial(_start_worker, loader.worker_init_fn)
    return loader


def store_ports() -> set[int]:
    """The job store's port, from the launch environment (empty without one)."""
    port = os.environ.get("MASTER_PORT")
    return {int(port)} if port else set()


def abort_world(backend: str) -> int:
    """Make every collective of this process's current world fail now.

    Args:
        backend: the world's backend (``"gloo"`` or ``"nccl"``).

    Returns:
        Sockets shut down (gloo), or the number of worlds aborted (NCCL: 0 or 1).
    """
    if backend == "nccl":
        if not dist.is_initialized():
            return 0
        try:
            dist.distributed_c10d._abort_process_group()
        except ValueError:  # aborted already (the verdict came first, then the failed call)
            return 0
        return 1
    return shut_world_sockets(store_ports())
