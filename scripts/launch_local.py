#!/usr/bin/env python
"""Single-node launcher whose surviving ranks keep running when one rank dies.

Responsible for: hosting the job's torch ``TCPStore`` in the launcher process (so the store
outlives every rank), starting ``--nproc-per-node`` independent worker processes with the
environment torchrun gives its workers, letting their output through unprefixed, forwarding
SIGINT/SIGTERM to them, killing ranks left stopped by a signal once every other rank has ended
(nothing can continue them), and reporting each rank's end. It is a child subreaper: when the rank
fork server of its own dies (an out-of-memory kill picks it, say), the ranks become its children
and train on, and it waits for their ends itself.

It must never kill the other ranks when one exits non-zero or is killed: in-place recovery needs
the survivors alive. (torchrun's agent does the opposite: it tears down every local worker as soon
as one fails, and restarts the whole group if asked to.)

Usage::

    python scripts/launch_local.py --nproc-per-node N [--master-addr 127.0.0.1] \
        [--master-port P] [--preload auto|none|MODULE[,MODULE...]] [--fork-server SOCKET] SCRIPT [ARGS...]

Ranks are forked from a server that has imported the script's top-level modules once
(``rank_fork_server.py``); ``--preload none`` starts each from a bare interpreter instead, and
``--fork-server SOCKET`` (or ``$RESIHP_FORK_SERVER``) from a server shared by many launches
(``shared_fork_server.py``) that imported them once for all.

Exit code: 0 when every rank that was not killed by a signal, and did not leave on an error of its
own (exit 4), exited 0 and at least one rank finished that way (a job that survived its failed
ranks succeeds); otherwise 3 when any rank exited
3 (survivors wrote a fallback checkpoint: resume it), else the first non-zero code a rank returned,
or 128 + signal number when every rank was killed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from rank_fork_server import Preload, RankForkServer, ServerRefused, script_preload
from megatron.resihp.heartbeat_beacon import stopped_by_signal
from megatron.resihp.parent_death import become_subreaper

# Workers read this to know that a dead peer does not take them down with it.
LAUNCHER_ENV = "RESIHP_LAUNCHER"
# The shared fork server's socket, when --fork-server is not given.
FORK_SERVER_ENV = "RESIHP_FORK_SERVER"
# How often the launcher looks at its workers; a rank's end is reported within this.
_POLL_S = 0.05
# A rank's exit codes that the launcher reads (megatron.resihp.fail_stop_recovery's EXIT_NEEDS_RESTART
# and EXIT_RANK_FAILED, and the argument parsers' code for refused input).
FALLBACK_EXIT = 3
INPUT_ERROR_EXIT = 2
RANK_FAILED_EXIT = 4
# After forwarding SIGINT/SIGTERM, workers get this long to exit before SIGKILL (torchrun waits
# a similar grace period before escalating).
_GRACE_S = 15.0
# Ranks stopped by a signal (SIGSTOP, SIGTSTP) while every other rank has ended are killed once
# they have stood so this long: nothing is left to continue them (their peers are gone), and the
# launch would wait on them forever. A rank's beacon fences it when the job ends; this covers a
# rank whose beacon died first, which the others named dead by its heartbeat's timeout.
_STOPPED_ALONE_S = 5.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 with the fix, not just the complaint
        self.print_usage(sys.stderr)
        self.exit(2, f"launch_local: error: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="launch_local.py",
        description="Start N ranks of SCRIPT on this node; survivors keep running when a rank dies.",
        allow_abbrev=False,
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, required=True,
                        help="number of ranks (worker processes) to start")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                        help="address the job's TCPStore listens on (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=0,
                        help="port of the job's TCPStore (default: a free port chosen by the OS)")
    parser.add_argument("--preload", default="auto",
                        help="modules to import once, before the ranks are forked: 'auto' (default) for "
                             "those the script imports at its top level, 'none', or a comma-separated list")
    parser.add_argument("--fork-server", default=None, metavar="SOCKET",
                        help="fork the ranks from the shared fork server listening at SOCKET "
                             "(scripts/shared_fork_server.py), which imported the script's modules once for "
                             f"many launches (default: ${FORK_SERVER_ENV} when set, else a server of this "
                             "launch's own)")
    parser.add_argument("script", help="training script to run on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}; pass the number of ranks to start")
    if not 0 <= args.master_port < 2**16:
        parser.error(f"--master-port must be in 0..65535, got {args.master_port}; omit it to pick a free port")
    if not os.path.isfile(args.script):
        parser.error(f"SCRIPT {args.script!r} is not a file; pass the path of the training script after the flags")
    if args.preload == "none" and args.fork_server:
        parser.error("--preload none starts the ranks from a bare interpreter, and --fork-server from one "
                     "that imported the script's modules; drop one of them")
    if args.fork_server is None and args.preload != "none":  # --preload none asks for what the default would not give
        args.fork_server = os.environ.get(FORK_SERVER_ENV) or None
    try:
        args.preload = preload_modules(args.preload, args.script)
    except SyntaxError as err:
        parser.error(f"--preload auto could not read the imports of {args.script!r} ({err}); "
                     "fix the script or pass --preload none")
    return args


def preload_modules(spec: str, script: str) -> Preload:
    if spec == "auto":
        return script_preload(script)
    if spec == "none":
        return Preload()
    return Preload(tuple(m.strip() for m in spec.split(",") if m.strip()))


def worker_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment torchrun gives a worker, for a single node."""
    return {**os.environ, **rank_vars(rank, world_size, master_addr, master_port)}


def rank_vars(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables a rank of this node reads to find its place and the job's store (also what
    ``scripts/slurm/slurm_rank.py`` starts from under Slurm)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # torch's env:// rendezvous then makes every rank, rank 0 included, a client of the
        # launcher's store instead of having rank 0 host it (the store would die with rank 0).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        LAUNCHER_ENV: "launch_local",
    }


@dataclass
class _Job:
    pids: dict[int, int]  # rank -> pid
    codes: dict[int, int] = field(default_factory=dict)  # rank -> returncode (negative: signal)
    order: list[int] = field(default_factory=list)  # ranks in the order they ended

    def running(self) -> list[int]:
        return [r for r in sorted(self.pids) if r not in self.codes]

    def signal_running(self, sig: int) -> None:
        for r in self.running():
            try:
                os.kill(self.pids[r], sig)
            except ProcessLookupError:
                pass


class _StoppedAlone:
    """Watches for ranks that are all stopped by a signal once every other rank has ended."""

    def __init__(self) -> None:
        self._since: float | None = None

    def kill_if_standing(self, job: _Job) -> None:
        """SIGKILL ``job``'s running ranks when some rank has ended and every running one has been
        stopped by a signal for ``_STOPPED_ALONE_S``."""
        running = job.running()
        if not (job.codes and running and all(stopped_by_signal(job.pids[r]) for r in running)):
            self._since = None
            return
        now = time.monotonic()
        self._since = self._since or now
        if now - self._since < _STOPPED_ALONE_S:
            return
        print(f"launch_local: ranks {running} stopped by a signal {now - self._since:.0f} s ago and every other "
              "rank has ended: nothing can continue them; killing them", file=sys.stderr, flush=True)
        job.signal_running(signal.SIGKILL)
        self._since = float("inf")  # said once; their ends are reported as they come


def exit_code(codes: dict[int, int], order: list[int]) -> int:
    """The launcher's exit code from each rank's return code (negative = killed by that signal)."""
    finished = [r for r in order if codes[r] >= 0]
    failed = [r for r in finished if codes[r] != 0]
    # A rank that left on an error of its own is a failed rank, as one killed by a signal is.
    if finished and all(codes[r] == RANK_FAILED_EXIT for r in failed) and len(failed) < len(finished):
        return 0
    if any(codes[r] == FALLBACK_EXIT for r in failed):
        # Survivors wrote a fallback checkpoint and printed its resume command: say so, whatever
        # the ranks that died first returned, so a supervisor knows to resume rather than debug.
        return FALLBACK_EXIT
    if failed:
        return codes[failed[0]]
    first = codes[order[0]] if order else 1
    return 128 - first if first < 0 else (first or 1)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _store_failed(args: argparse.Namespace, err: Exception) -> SystemExit:
    """Say why the job's store did not start; the exit: 2 when the port asked for is the cause."""
    said = str(err).splitlines()[0]
    if args.master_port and ("EADDRINUSE" in said or "address already in use" in said):
        print(f"launch_local: error: --master-port {args.master_port} is in use on this host ({said}); pass a free "
              "port, or omit the flag for one the OS picks", file=sys.stderr, flush=True)
        return SystemExit(INPUT_ERROR_EXIT)
    print(f"launch_local: the job's store did not start at {args.master_addr}:{args.master_port}: {said}",
          file=sys.stderr, flush=True)
    return SystemExit(1)


def _rank_server(args: argparse.Namespace) -> RankForkServer:
    """The shared fork server's server for this launch when one is asked for and takes it (it
    starts the job's store too), else a server of the launch's own.

    Raises:
        SystemExit: the shared server asked for is not there (2), or the job's store it starts
            did not start (2 when --master-port is in use, else 1); said on stderr.
    """
    if args.fork_server:
        try:
            return RankForkServer.connect(args.fork_server, args.script, args.script_args, args.preload,
                                          (args.master_addr, args.master_port))
        except ServerRefused as refused:
            print(f"launch_local: {refused}; this launch forks a server of its own", file=sys.stderr, flush=True)
        except OSError as err:
            print(f"launch_local: error: --fork-server {args.fork_server}: no fork server answers there "
                  f"({err.strerror or err}); start one with `python scripts/shared_fork_server.py "
                  f"{args.fork_server} SCRIPT`, or drop the flag (and unset {FORK_SERVER_ENV})",
                  file=sys.stderr, flush=True)
            raise SystemExit(INPUT_ERROR_EXIT) from None
        except RuntimeError as err:
            raise _store_failed(args, err) from None
    # Forked before the store: the server must not inherit the store's thread.
    return RankForkServer.start(args.script, args.script_args, args.preload)


def _reap(job: _Job, timeout_s: float) -> list[tuple[int, int]]:
    """(rank, exit code) of ``job``'s running ranks that ended, waited for by this process (their
    server died, and they are its children now); one gone without having been its child counts as
    killed."""
    ended = []
    for rank in job.running():
        try:
            pid, status = os.waitpid(job.pids[rank], os.WNOHANG)
        except ChildProcessError:
            # The kernel closes a dying server's pipes before it hands the server's children over,
            # so for a moment a live rank is nobody's to wait for; a rank gone by now ended before
            # the server, which reaped it and died before saying so.
            try:
                os.kill(job.pids[rank], 0)
            except ProcessLookupError:
                ended.append((rank, -signal.SIGKILL))
            continue
        if pid:
            ended.append((rank, os.waitstatus_to_exitcode(status)))
    if not ended:
        time.sleep(timeout_s)
    return ended


def run(args: argparse.Namespace) -> int:
    # Before the server is forked: a rank whose server dies becomes this process's child and goes on.
    adopts = become_subreaper()
    server = _rank_server(args)
    store = None
    if server.store_port is None:
        from torch.distributed import TCPStore  # imported late so --help and CLI errors stay fast

        # The store lives here, not in rank 0: it must outlive any rank for survivors to re-form.
        try:
            store = TCPStore(args.master_addr, args.master_port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(minutes=30))
        except RuntimeError as err:  # torch's DistNetworkError among them
            os.kill(server.pid, signal.SIGKILL)  # still importing what no rank will run
            server.close()
            raise _store_failed(args, err) from None
    store_port = server.store_port if store is None else store.port
    world_size = args.nproc_per_node
    received: list[int] = []
    job = _Job({})

    def forward(signum, _frame):
        received.append(signum)
        # A second signal means "now": skip the grace period.
        job.signal_running(signal.SIGKILL if len(received) > 1 else signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.pids.update(server.spawn([worker_env(r, world_size, args.master_addr, store_port)
                                      for r in range(world_size)]))
        if received:  # a signal that came while the ranks were being started
            job.signal_running(received[-1])
        deadline = None
        stopped_alone = _StoppedAlone()
        orphans = False
        while job.running():
            for rank, code in (_reap(job, _POLL_S) if orphans else server.ended(_POLL_S)):
                job.codes[rank] = code
                job.order.append(rank)
                # A rank exiting 2 refused its input and said why (once, on rank 0).
                if code not in (0, INPUT_ERROR_EXIT):
                    print(f"launch_local: rank {rank} exited with {_describe(code)}; "
                          f"{len(job.running())} ranks still running", file=sys.stderr, flush=True)
            if server.gone and job.running() and not orphans:
                if not (adopts and server.pid is not None):
                    print(f"launch_local: the rank fork server ended with ranks {job.running()} unreported; "
                          "stopping them", file=sys.stderr, flush=True)
                    return 1
                print(f"launch_local: the rank fork server died; ranks {job.running()} go on as this launcher's "
                      "children", file=sys.stderr, flush=True)
                orphans = True
            stopped_alone.kill_if_standing(job)
            if received and deadline is None:
                deadline = time.monotonic() + _GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                job.signal_running(signal.SIGKILL)
                deadline = float("inf")
    finally:
        job.signal_running(signal.SIGKILL)  # only reached with ranks left on a launcher error
        for s, handler in old.items():
            signal.signal(s, handler)
        server.close()
    return exit_code(job.codes, job.order)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
