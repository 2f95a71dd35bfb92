"""A rank's heartbeat, written by a small child process instead of a thread of the rank.

Responsible for: keeping a rank's heartbeat on time whatever its training thread does. A thread
inside the training process needs the GIL to run, and the training thread can hold it for longer
than a heartbeat timeout: measured on a loaded 2-core host, every rank's heartbeat thread of an
8-rank job stood still 1.0-1.5 s at once while the training thread sat in megatron-core's forward
(C code that keeps the GIL), and that was enough to call live ranks dead. The beacon is a process
of its own, forked before the rank starts any thread, so no lock of the rank can delay it.

The rank and its beacon share one anonymous shared-memory page: the rank writes what to publish
(key, training progress, a mark), the beacon publishes it to the job's store every interval with
its own clock and its own store connection, and acknowledges what it published. Two more things
only a separate process can do:

* when the rank dies (the kernel tells the beacon through ``PR_SET_PDEATHSIG``), the beacon writes
  a ``dead`` mark at once, so survivors name a killed rank within one poll instead of after
  ``--resihp-heartbeat-timeout-s``; the timeout still covers a lost node, where the beacon dies too;
* when the survivors ``evict`` the rank (judged hung, or a standby stopped by a signal when the
  job ends), the beacon SIGKILLs it, even if the rank is stuck in C code holding the GIL, where a
  thread of its own could never run; the mark it then leaves is ``fenced``, not ``dead``: the
  survivors made that decision already;
* when the rank has been stopped by a signal (SIGSTOP, SIGTSTP: state ``T`` in ``/proc``) for
  ``stopped_after_s``, the beacon writes a ``stopped`` mark, so survivors name the hang within a
  poll instead of waiting for the others' collectives to time out. A rank merely paused by a
  debugger or profiler (``t``, tracing stop) is not marked.

A rank that is alive but stuck keeps beating through its beacon with progress standing still: that
is a hang, for ``hang_rules``, never a death.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time

from megatron.resihp.parent_death import signal_on_parent_death

logger = logging.getLogger(__name__)

# What the rank says of itself: recovering, exited, or what its training thread is doing now
# (``hang_rules.main_thread_state``: waiting in a collective, writing a checkpoint, compiling a
# graph; no mark: working).
MARK_NONE, MARK_RECOVERING, MARK_EXIT, MARK_WAITING, MARK_IO, MARK_COMPILING = 0, 1, 2, 3, 4, 5
MARK_TEXT = {MARK_NONE: "", MARK_RECOVERING: "recovering", MARK_EXIT: "exit", MARK_WAITING: "waiting", MARK_IO: "io",
             MARK_COMPILING: "compiling"}
DEAD_MARK = "dead"
# Dead after the survivors evicted it: their decision, already made, so no news to anyone.
FENCED_MARK = "fenced"
# Alive but stopped by a signal: it makes no progress until someone continues it.
STOPPED_MARK = "stopped"

# Shared page layout: version (seqlock: odd while the rank writes), progress, mark, key length,
# evicted-key length, acknowledged version, then the two keys.
_HEADER = struct.Struct("<qqiiiq")
_ACK_AT = 28
_KEYS_AT = _HEADER.size
_PAGE = 4096


def heartbeat_text(at: float, progress: int, mark: str = "") -> str:
    """A heartbeat as the job's store holds it: ``time:progress[:mark]``."""
    return f"{at:.6f}:{progress}" + (f":{mark}" if mark else "")


def read_heartbeat(text: str | bytes) -> tuple[float, int, str]:
    """The time, progress and mark ("" for none) of a ``heartbeat_text``."""
    parts = (text.decode() if isinstance(text, bytes) else text).split(":")
    return float(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else ""


_BEACON: Beacon | None = None


class Beacon:
    """The rank's side: tell the beacon process what to publish."""

    def __init__(self, page: mmap.mmap, pid: int, interval_s: float):
        self._page = page
        self.pid = pid
        self.interval_s = interval_s
        self._progress = -1
        self._mark = MARK_NONE
        self._key = b""
        self._evicted_key = b""
        self._version = 0
        # The training thread writes progress, the watchdog thread marks: one writer at a time.
        self._lock = threading.Lock()

    def point_at(self, key: str, evicted_key: str) -> None:
        """Publish under ``key`` from now on (a new monitor: new generation, new rank)."""
        self._key, self._evicted_key = key.encode(), evicted_key.encode()
        if len(self._key) + len(self._evicted_key) > _PAGE - _KEYS_AT:
            raise ValueError(f"heartbeat beacon: keys too long ({key!r}, {evicted_key!r})")
        self._progress, self._mark = -1, MARK_NONE
        self._write()

    def set_progress(self, progress: int) -> None:
        self._progress = int(progress)
        self._write()

    def set_mark(self, mark: int) -> None:
        self._mark = mark
        self._write()

    def wait_published(self, timeout_s: float) -> bool:
        """Wait until the beacon has published the latest state; False on timeout (beacon gone)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _HEADER.unpack_from(self._page, 0)[5] >= self._version:
                return True
            time.sleep(min(0.02, self.interval_s / 4))
        return False

    def alive(self) -> bool:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def _write(self) -> None:
        # Only the rank writes these fields; the beacon retries a read that overlapped a write.
        with self._lock:
            self._version += 2
            struct.pack_into("<q", self._page, 0, self._version - 1)
            struct.pack_into("<qii", self._page, 8, self._progress, self._mark, len(self._key))
            struct.pack_into("<i", self._page, 24, len(self._evicted_key))
            self._page[_KEYS_AT:_KEYS_AT + len(self._key) + len(self._evicted_key)] = self._key + self._evicted_key
            struct.pack_into("<q", self._page, 0, self._version)


def current() -> Beacon | None:
    """The beacon started by ``start_beacon`` in this process, if any."""
    return _BEACON


def start_beacon(interval_s: float, store_timeout_s: float = 60.0, stopped_after_s: float | None = None
                 ) -> Beacon | None:
    """Fork this rank's beacon. Call before the rank starts any thread (forking a process with
    threads can leave the child holding a lock nobody will release).

    Args:
        interval_s: seconds between two heartbeats.
        store_timeout_s: how long one store operation may block.
        stopped_after_s: mark the rank ``stopped`` once it has been stopped by a signal this long
            (None: never).

    Returns None where no job store is set (``MASTER_ADDR``/``MASTER_PORT``) or fork is missing.
    """
    global _BEACON
    if _BEACON is not None:
        return _BEACON
    if not hasattr(os, "fork") or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    page = mmap.mmap(-1, _PAGE)  # anonymous and shared: both sides of the fork see one page
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the beacon: never return into the rank's code
        code = 0
        try:
            _beacon_main(page, parent, interval_s, store_timeout_s, stopped_after_s)
        except BaseException:  # noqa: BLE001 - report and leave; the rank's monitor notices
            logger.exception("heartbeat beacon of pid %d failed", parent)
            code = 1
        finally:
            os._exit(code)
    _BEACON = Beacon(page, pid, interval_s)
    return _BEACON


def _read_state(page: mmap.mmap, previous: tuple | None) -> tuple[int, int, int, bytes, bytes] | None:
    """The rank's latest consistent write; ``previous`` if none shows up (the rank died mid-write)."""
    for _ in range(100):
        version, progress, mark, key_len, evicted_len, _ = _HEADER.unpack_from(page, 0)
        keys = page[_KEYS_AT:_KEYS_AT + key_len + evicted_len]
        if version % 2 == 0 and struct.unpack_from("<q", page, 0)[0] == version:
            return version, progress, mark, keys[:key_len], keys[key_len:]
        time.sleep(0.001)
    return previous


def stopped_by_signal(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal now (``T`` in ``/proc/<pid>/stat``; not a tracing stop)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:  # gone, or no /proc here
        return False
    # The command name is in parentheses and may hold spaces: the state follows the last ')'.
    return text[text.rindex(b")") + 2:][:1] == b"T"


def _beacon_main(page: mmap.mmap, parent: int, interval_s: float, store_timeout_s: float,
                 stopped_after_s: float | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the rank to handle
    parent_died = []
    signal.signal(signal.SIGTERM, lambda *_: parent_died.append(True))
    # Not on Linux, the getppid() checks still notice, one interval later.
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent:
        return
    from megatron.resihp.heartbeat import connect_store

    store = connect_store(timeout_s=store_timeout_s)
    evicted_seen = False
    state = None
    stopped_since = None
    failing = False
    next_at = time.monotonic()
    while True:
        gone = parent_died or os.getppid() != parent
        if stopped_after_s is not None and not gone and stopped_by_signal(parent):
            stopped_since = stopped_since or time.monotonic()
        else:
            stopped_since = None
        state = _read_state(page, state)
        if state is None:  # nothing consistent written yet
            if gone:
                return
            time.sleep(interval_s)
            continue
        version, progress, mark, key, evicted_key = state
        if key:
            at = time.time()
            try:
                if gone and mark != MARK_EXIT:
                    evicted_seen = evicted_seen or store.check([evicted_key.decode()])
                    said = FENCED_MARK if evicted_seen else DEAD_MARK
                elif stopped_since is not None and time.monotonic() - stopped_since >= stopped_after_s:
                    said = STOPPED_MARK
                else:
                    said = MARK_TEXT[mark]
                store.set(key.decode(), heartbeat_text(at, progress, said))
                if not gone and not evicted_seen and store.check([evicted_key.decode()]):
                    evicted_seen = True
                    print(f"heartbeat: beacon fences pid {parent}: the other ranks left it behind",
                          file=sys.stderr, flush=True)
                    os.kill(parent, signal.SIGKILL)
                failing = False
            except Exception as err:  # noqa: BLE001 - a store hiccup must not end the beacon
                if gone:
                    return
                if not failing:  # once per spell: a store that is gone fails every beat
                    logger.warning("heartbeat beacon: store operation failed: %s", str(err).splitlines()[0])
                failing = True
        struct.pack_into("<q", page, _ACK_AT, version)
        if gone:
            return
        next_at = max(next_at + interval_s, time.monotonic())
        time.sleep(max(0.0, next_at - time.monotonic()))
