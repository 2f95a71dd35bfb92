#!/usr/bin/env python
"""Hosts a Slurm job's torch ``TCPStore`` in a process that is not a training rank.

Responsible for: listening on ``--port`` (0: a free port the OS picks), writing the port it got to
``--port-file`` once it listens (written whole, then renamed, so a reader never sees half), and
serving until SIGTERM/SIGINT. ``pretrain_resilient.sbatch`` runs it in the batch script, on the
allocation's first node, before the training step starts.

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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.print_usage(sys.stderr)
        self.exit(2, f"job_store: error: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="job_store.py", description="Host a job's TCPStore until SIGTERM.", allow_abbrev=False)
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free port)")
    parser.add_argument("--port-file", required=True, help="file to write the port to once the store listens")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 2**16:
        parser.error(f"--port must be in 0..65535, got {args.port}; omit it to pick a free port")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.port_file))):
        parser.error(f"--port-file {args.port_file!r}: its folder does not exist; create it first")
    return args


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
    tmp = f"{args.port_file}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{store.port}\n")
    os.replace(tmp, args.port_file)
    print(f"job_store: serving on port {store.port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    signal.sigwait(stop_signals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
