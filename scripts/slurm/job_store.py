#!/usr/bin/env python
"""Hosts a Slurm job's torch ``TCPStore`` in a process that is not a training rank.

Responsible for: listening on ``--port`` (0: a free port the OS picks), writing the port it got to
``--port-file`` once it listens (written whole, then renamed, so a reader never sees half), and
serving until SIGTERM/SIGINT. ``pretrain_resilient.sbatch`` runs it in the batch script, on the
allocation's first node, before the training step starts. With ``--done-file``, it also writes that
file once the ranks set ``--done-key`` (the job's end: ``megatron.resihp.standby_keys.DONE``), so
the batch script can end a step that a rank left behind keeps alive (``pretrain_resilient.sbatch``).

Why outside the ranks: survivors of a dead rank re-form their groups under a fresh prefix of this
store, and every rank's heartbeat goes through it; hosted by rank 0 (torch's default), it would die
with rank 0. It is the same store ``scripts/launch_local.py`` hosts in its own process on one node.
Losing the node it runs on is therefore not survivable; every other node is.

It must never run training code or import megatron.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

# Seconds between two looks for the job's end; the batch script waits far longer after it.
_DONE_POLL_S = 0.5


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.print_usage(sys.stderr)
        self.exit(2, f"job_store: error: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="job_store.py", description="Host a job's TCPStore until SIGTERM.", allow_abbrev=False)
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free port)")
    parser.add_argument("--port-file", required=True, help="file to write the port to once the store listens")
    parser.add_argument("--done-file", help="file to write once the job's end is marked under --done-key")
    parser.add_argument("--done-key", help="the store key the ranks set when the job has ended")
    args = parser.parse_args(argv)
    if (args.done_file is None) != (args.done_key is None):
        parser.error("--done-file and --done-key go together; pass both or neither")
    if not 0 <= args.port < 2**16:
        parser.error(f"--port must be in 0..65535, got {args.port}; omit it to pick a free port")
    for flag, path in (("--port-file", args.port_file), ("--done-file", args.done_file)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag} {path!r}: its folder does not exist; create it first")
    return args


def _write_whole(path: str, text: str) -> None:
    """Write ``path`` whole, then rename it into place: a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Blocked before the store starts its threads (they inherit the mask), then waited for: a
    # signal that comes at any moment ends the wait, none is lost between a check and a pause.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    from torch.distributed import TCPStore  # late: usage errors stay fast

    # The host argument only matters to the server's own client connection; the server listens on
    # every interface, so ranks on other nodes reach it by the node's name.
    store = TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(minutes=30))
    _write_whole(args.port_file, f"{store.port}\n")
    print(f"job_store: serving on port {store.port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if args.done_file is not None:
        while not store.check([args.done_key]):
            if signal.sigtimedwait(stop_signals, _DONE_POLL_S) is not None:
                return 0
        _write_whole(args.done_file, f"{time.time():.3f}\n")  # when the job's end was seen
    signal.sigwait(stop_signals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
