#!/usr/bin/env python
"""A rank fork server that outlives launches: many launches' ranks forked from one import.

Responsible for: importing a training script's top-level modules once; listening on a Unix socket
for ``launch_local.py --fork-server PATH``; and, per launch, forking a server for that launch alone
which takes over the launcher's stdin, stdout and stderr (handed over by descriptor), runs in the
launcher's working directory, starts the job's store in a process of its own, and forks, reports
and reaps the launch's ranks as the server that ``rank_fork_server.py`` forks inside a launcher does.

Why: a launcher pays the imports of torch and megatron-core on every launch (about 5 s of CPU in
its own server, and 2 s in the launcher for the store); a workload of many short jobs (a test
suite, a sweep of small runs) pays them once, and its launchers import no torch at all.

What a launch's ranks see is what a launcher's own server gives them, with two differences: the
modules were imported under this server's environment, so a launch whose environment differs
(other than in the variables named by ``--ignore-env``) is declined and its launcher forks a server
of its own; and a launch's server is this server's child, not the launcher's, so it ends when the
launcher's connection closes (the launcher ended, however), and its ranks then get SIGTERM as with
a launcher's own server. The job's store lives exactly as long as the launch's server, as it lives
as long as the launcher otherwise. Every launch's server dies with this server.

Usage::

    python scripts/shared_fork_server.py SOCKET SCRIPT [--ignore-env NAME ...] [--die-with-parent]

It prints ``ready`` on stdout once it listens, and ends on SIGTERM or SIGINT, removing SOCKET.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import signal
import socket
import sys

from megatron.resihp.parent_death import signal_on_parent_death
from rank_fork_server import Preload, _fork, cuda_initialised, script_preload, serve_job

# How often the server reaps the launches' servers that ended.
_REAP_S = 1.0


def _declined(env: dict[str, str], own: dict[str, str], ignored: frozenset[str]) -> str | None:
    """Why a launch with environment ``env`` cannot use modules imported under ``own`` (None: it can)."""
    differing = sorted(k for k in set(env) | set(own) if k not in ignored and env.get(k) != own.get(k))
    if not differing:
        return None
    return (f"the fork server imported its modules under another environment (differing: "
            f"{', '.join(differing[:8])}{' ...' if len(differing) > 8 else ''})")


def _start_store(addr: str, port: int) -> int | str:
    """Start the job's store in a process of its own (forked before any rank, so that no rank
    inherits its thread) that lives as long as this launch's server; return its port, or why it
    did not start."""
    report_r, report_w = os.pipe()
    if _fork() == 0:
        try:
            os.close(report_r)
            signal_on_parent_death(signal.SIGKILL)
            from torch.distributed import TCPStore

            try:
                store = TCPStore(addr, port, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(minutes=30))
            except Exception as err:  # noqa: BLE001 - the launcher says why
                os.write(report_w, f"!{str(err).splitlines()[0]}\n".encode())
                raise SystemExit(1) from None
            os.write(report_w, f"{store.port}\n".encode())
            os.close(report_w)
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(report_w)
    with os.fdopen(report_r) as report:
        told = report.readline().strip()
    if not told.isdigit():
        return told[1:] or "it ended without saying why"
    return int(told)


def _launch_main(conn: socket.socket, own_env: dict[str, str], ignored: frozenset[str], fresh: bool) -> None:
    """Body of one launch's server; never returns."""
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to forward
        signal_on_parent_death(signal.SIGKILL)
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        fd = conn.detach()
        commands, events = os.fdopen(fd, "r"), os.fdopen(os.dup(fd), "w")
        hello = json.loads(commands.readline())
        reason = _declined(hello["env"], own_env, ignored)
        if reason is not None:
            events.write(f"refused {reason}\n")
            events.flush()
            return
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(fds[hello["stdio"].index(target)] if target in hello["stdio"] else null, target)
        for received in (*fds, null):
            os.close(received)
        store = _start_store(*hello["store"])
        if isinstance(store, str):
            events.write(f"failed {store}\n")
            events.flush()
            return
        os.chdir(hello["cwd"])
        script = hello["script"]
        sys.path[0] = os.path.dirname(script)  # as ``python SCRIPT`` sets it
        Preload.from_dict(hello["preload"]).apply()  # what this server's own script did not import
        events.write(f"ok {store}\n")
        events.flush()
        serve_job(commands, events, script, hello["script_args"], fresh or cuda_initialised())
    except BaseException:  # noqa: BLE001 - the launcher sees the connection close and reports it
        code = 1
    finally:
        os._exit(code)


def serve(path: str, script: str, ignored: frozenset[str], die_with_parent: bool) -> None:
    """Import ``script``'s modules, then fork a server for each launch that connects to ``path``."""
    own_env = dict(os.environ)
    if die_with_parent:
        signal_on_parent_death(signal.SIGTERM)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # As in a launcher's own server: torch answers whether CUDA is there from NVML, and the driver,
    # which does not survive a fork, stays unstarted.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    script_preload(script).apply()
    fresh = cuda_initialised()

    def leave(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    try:
        listener.listen(64)
        print("ready", flush=True)
        while True:
            ready, _, _ = select.select([listener], [], [], _REAP_S)
            while True:
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
            if not ready:
                continue
            conn, _ = listener.accept()
            if _fork() == 0:
                listener.close()
                _launch_main(conn, own_env, ignored, fresh)
            conn.close()
    finally:
        listener.close()
        os.unlink(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shared_fork_server.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("socket", help="path of the Unix socket to listen on (must not exist)")
    parser.add_argument("script", help="training script whose top-level modules to import")
    parser.add_argument("--ignore-env", action="append", default=[], metavar="NAME",
                        help="an environment variable that may differ between this server and a launch "
                             "(read only at run time, never while the script's modules are imported)")
    parser.add_argument("--die-with-parent", action="store_true",
                        help="end when the process that started this one ends (Linux)")
    args = parser.parse_args(argv)
    if os.path.exists(args.socket):
        parser.exit(2, f"shared_fork_server.py: error: {args.socket} exists; remove it or pass another path\n")
    if not os.path.isfile(args.script):
        parser.exit(2, f"shared_fork_server.py: error: SCRIPT {args.script!r} is not a file\n")
    serve(args.socket, args.script, frozenset(args.ignore_env), args.die_with_parent)


if __name__ == "__main__":
    main()
