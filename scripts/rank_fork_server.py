"""Starts a job's ranks from one process that has already imported what they import.

Responsible for: forking, before the launcher starts any thread, a server process that imports
the training script's modules once; forking each rank from it with the rank's environment and
running the script there as ``python -u SCRIPT ARGS`` would; reporting every rank's pid and, as
each ends, its exit code (negative: killed by that signal) back to the launcher.

Why: importing torch and megatron-core costs each rank about 4 s of CPU. Eight ranks on a small
host pay that eight times over before the first iteration; forked from a server that paid it once,
they share the imported modules copy-on-write and start at once. (PyTorch's DataLoader forks its
workers from processes that imported torch in the same way.)

It must never leave ranks behind the launcher: the server dies with the launcher
(``PR_SET_PDEATHSIG`` = SIGKILL) and a rank whose server died is told so by a signal of its own
(``RANK_PARENT_DEATH_SIGNAL``). If its server's parent, the launcher, is alive, and is a child
subreaper (``launch_local.py`` makes itself one), the rank is the launcher's child now and goes on:
a helper that only forks ranks must not take a training job down with it. Otherwise (the launcher
went first) the rank is sent SIGTERM, as a launcher's end would send it: without the launcher's
store no rank could recover anyway. If the preloaded modules initialised CUDA, which a forked
child cannot use, ranks are exec'd fresh instead of run in the fork, and die with the server.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import select
import signal
import socket
import sys
import warnings
from dataclasses import dataclass

from megatron.resihp.parent_death import signal_on_parent_death

# What a forked rank's parent death sends it: a signal that nothing else sends, whose handler asks
# who its parent is now (a real-time one: its default, where no handler runs, ends the process).
RANK_PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 2
# How often a job's server looks for ranks that ended (and for its launcher's end).
_REAP_S = 0.02


_WARNING_FILTERS = ("filterwarnings", "simplefilter")


@dataclass(frozen=True)
class Preload:
    """What the server does before forking: set the script's warning filters, import modules."""

    modules: tuple[str, ...] = ()
    # (function of ``warnings``, positional args, keyword args), each argument a literal
    warning_filters: tuple[tuple[str, tuple, dict], ...] = ()

    def to_dict(self) -> dict:
        return {"modules": list(self.modules), "warning_filters": [list(f) for f in self.warning_filters]}

    @classmethod
    def from_dict(cls, data: dict) -> Preload:
        return cls(tuple(data["modules"]), tuple((name, tuple(args), kwargs) for name, args, kwargs
                                                  in data["warning_filters"]))

    def apply(self) -> None:
        for name, args, kwargs in self.warning_filters:
            getattr(warnings, name)(*args, **kwargs)
        for module in self.modules:
            try:
                __import__(module)
            except Exception:  # noqa: BLE001 - the rank imports it again and reports the error
                pass
        # Every object imported so far out of the collector's reach: a forked rank's collections
        # would otherwise walk them all, each walk writing to (and so copying) the pages the ranks
        # share. Measured on an 8-rank job: Megatron's model-and-optimizer set-up 1.9-2.1 s -> 0.2 s.
        gc.freeze()


def script_preload(script: str) -> Preload:
    """The absolute modules the script imports at its top level (``from x import y`` gives ``x``),
    and those its ``if __name__ == "__main__":`` block imports before any other statement, and the
    warning filters it sets at its top level with literal arguments: what every rank does before
    anything rank-specific. The filters come along so that a warning the script silences before
    its imports stays silent when the server does the importing. A script keeps in its main block
    what a process it spawns must not import again (``multiprocessing``'s spawn runs the script's
    top level, as ``__mp_main__``, in every process it starts)."""
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=script)
    modules: list[str] = []
    filters = []
    for node in [*tree.body, *_main_block_imports(tree)]:
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names if a.name not in modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            modules += [node.module] if node.module not in modules else []
        elif _is_warning_filter(node):
            call = node.value
            try:
                args = tuple(ast.literal_eval(a) for a in call.args)
                kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            except ValueError:
                continue  # not literal: the rank sets it when it runs the script
            filters.append((call.func.attr, args, kwargs))
    return Preload(tuple(modules), tuple(filters))


def _main_block_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements that open the script's ``if __name__ == "__main__":`` block."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":  # unparse writes ' quotes
            leading = []
            for statement in node.body:
                if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                    break
                leading.append(statement)
            return leading
    return []


def _is_warning_filter(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in _WARNING_FILTERS
            and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "warnings"
            and all(k.arg is not None for k in node.value.keywords))


def _leave_unless_adopted_by(launcher: int):
    """The handler of ``RANK_PARENT_DEATH_SIGNAL`` in a rank whose server's parent is ``launcher``."""
    def server_gone(_signum, _frame):
        if os.getppid() != launcher:  # the launcher went first, or it adopts no orphans
            os.kill(os.getpid(), signal.SIGTERM)
    return server_gone


def _fork() -> int:
    with warnings.catch_warnings():
        # Python 3.12+ warns on fork() when torch's import has started a native thread; the rank
        # never relies on that thread's state (see the module docstring).
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _exit_code_of(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_script(script: str, script_args: list[str]) -> int:
    """Run the script as ``__main__`` the way the interpreter would; return its exit code (after
    an uncaught Ctrl-C, end by SIGINT as the interpreter does)."""
    import atexit
    import runpy
    import threading
    import traceback

    sys.argv = [script, *script_args]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # as ``python -u``
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code_of(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: print, exit 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # noqa: SLF001 - join non-daemon threads as interpreter exit does
    finally:
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _rank_main(script: str, script_args: list[str], env: dict[str, str], fresh: bool, launcher: int) -> None:
    """Body of a forked rank (``launcher``: its server's parent); never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # own process group: a terminal's Ctrl-C reaches it once, via the launcher
        signal.signal(RANK_PARENT_DEATH_SIGNAL, _leave_unless_adopted_by(launcher))
        signal_on_parent_death(RANK_PARENT_DEATH_SIGNAL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        if fresh:
            os.execve(sys.executable, [sys.executable, "-u", script, *script_args], env)
        code = _run_script(script, script_args)
    finally:
        os._exit(code & 0xFF)


def serve_job(commands, events, script: str, script_args: list[str], fresh: bool) -> None:
    """Fork one rank per environment the launcher sends on ``commands`` (one JSON line), report
    each rank's pid and, as each ends, its exit code on ``events``. Returns once every rank is
    reported, or as soon as the launcher's end of ``commands`` closes: the launcher is gone, and
    its ranks get SIGTERM through their parent-death signal once this process exits."""
    line = commands.readline()
    if not line:
        return
    ranks = {}
    launcher = os.getppid()
    for rank, env in enumerate(json.loads(line)):
        pid = _fork()
        if pid == 0:
            # Closed by descriptor: closing the file objects would flush what the server had
            # buffered, a second time, from here.
            os.close(commands.fileno())
            os.close(events.fileno())
            _rank_main(script, script_args, env, fresh, launcher)
        ranks[pid] = rank
        events.write(f"pid {rank} {pid}\n")
        events.flush()
    while ranks:
        ready, _, _ = select.select([commands.fileno()], [], [], _REAP_S)
        if ready and not os.read(commands.fileno(), 1):
            return
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in ranks:
                events.write(f"exit {ranks.pop(pid)} {os.waitstatus_to_exitcode(status)}\n")
                events.flush()


def cuda_initialised() -> bool:
    """Whether the preloaded modules started CUDA, which a forked rank could not use."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _server_main(commands, events, script: str, script_args: list[str], preload: Preload) -> None:
    """The fork server's body; never returns."""
    code = 0
    try:
        # Out of the launcher's process group: a signal to that group (a terminal's Ctrl-C, a
        # scheduler's SIGTERM) is for the launcher to forward to the ranks, and must not end the
        # server, whose end would tell the launcher that the ranks are lost.
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal_on_parent_death(signal.SIGKILL)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` sets it
        # A module that asks torch whether CUDA is available while it is imported would otherwise
        # start the CUDA driver here, and the driver does not survive a fork; torch answers from
        # NVML instead under this switch, which exists for this case. Ranks get the launcher's
        # environment, without it.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        preload.apply()
        serve_job(commands, events, script, script_args, cuda_initialised())
    except BaseException:  # noqa: BLE001 - the launcher sees the pipe close and reports it
        code = 1
    finally:
        os._exit(code)


class RankForkServer:
    """The launcher's side: start the server, have it fork the ranks, hear of their ends."""

    def __init__(self, pid: int | None, commands: int, events: int) -> None:
        self.pid = pid  # None: a job's server that a shared server forked (not this process's child)
        self._commands = commands  # fd, launcher -> server
        self._events = events  # fd, server -> launcher (the same socket as ``commands`` when shared)
        self._pending = b""
        self._early: list[str] = []  # ends heard while ranks were still being started
        self.gone = False  # the server ended (it does once every rank has been reported)
        self.store_port: int | None = None  # the port of the job's store when the server started it

    @classmethod
    def start(cls, script: str, script_args: list[str], preload: Preload) -> RankForkServer:
        """Fork the server. Call before the launcher starts any thread (e.g. its store)."""
        command_r, command_w = os.pipe()
        event_r, event_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = _fork()
        if pid == 0:
            os.close(command_w)
            os.close(event_r)
            _server_main(os.fdopen(command_r), os.fdopen(event_w, "w"), script, script_args, preload)
        os.close(command_r)
        os.close(event_w)
        return cls(pid, command_w, event_r)

    @classmethod
    def connect(cls, path: str, script: str, script_args: list[str], preload: Preload,
                store: tuple[str, int]) -> RankForkServer:
        """Have the shared server listening at ``path`` (``shared_fork_server.py``) fork a server
        for this launch, handing it this process's stdin, stdout and stderr for the ranks; that
        server starts the job's store at ``store`` (address, port; 0: a free one), whose port
        ``store_port`` then holds.

        Raises:
            OSError: nothing listens at ``path``.
            ServerRefused: the shared server imported under another environment than this
                process's; the ranks would not run as a server of this launch's own would run them.
            RuntimeError: the job's store did not start; the message is the store's error.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            stdio = [fd for fd in (0, 1, 2) if _is_open(fd)]
            socket.send_fds(sock, [b"\0"], stdio)
            hello = {"script": os.path.abspath(script), "script_args": script_args, "cwd": os.getcwd(),
                     "env": dict(os.environ), "stdio": stdio, "preload": preload.to_dict(), "store": list(store)}
            sock.sendall((json.dumps(hello) + "\n").encode())
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()
        server = cls(None, fd, fd)
        reply = server._lines(None)
        kind, _, said = reply[0].partition(" ") if reply else ("refused", "", "it closed the connection")
        if kind != "ok":
            server.close()
            raise (RuntimeError if kind == "failed" else ServerRefused)(said)
        server.store_port = int(said)
        return server

    def _lines(self, timeout_s: float | None) -> list[str]:
        ready, _, _ = select.select([self._events], [], [], timeout_s)
        if not ready:
            return []
        data = os.read(self._events, 65536)
        if not data:
            self.gone = True
            return []
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [line.decode() for line in lines]

    def spawn(self, envs: list[dict[str, str]]) -> dict[int, int]:
        """Fork one rank per environment (rank i gets ``envs[i]``); return rank -> pid."""
        data = (json.dumps(envs) + "\n").encode()
        while data:
            data = data[os.write(self._commands, data):]
        pids: dict[int, int] = {}
        while len(pids) < len(envs):
            for line in self._lines(None):
                kind, rank, value = line.split()
                if kind == "pid":
                    pids[int(rank)] = int(value)
                else:  # a rank that ended before the others were started
                    self._early.append(line)
            if self.gone:
                raise RuntimeError(f"the rank fork server ended after starting {len(pids)} of {len(envs)} ranks")
        return pids

    def ended(self, timeout_s: float) -> list[tuple[int, int]]:
        """(rank, exit code) of ranks that ended since the last call, waiting up to ``timeout_s``
        for the first; exit codes are negative for ranks killed by a signal."""
        lines, self._early = self._early + self._lines(timeout_s), []
        return [(int(rank), int(code)) for _, rank, code in (line.split() for line in lines)]

    def close(self) -> None:
        os.close(self._commands)
        if self._events != self._commands:
            os.close(self._events)
        if self.pid is None:
            return
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class ServerRefused(Exception):
    """A shared fork server declined a launch; the message says why."""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
