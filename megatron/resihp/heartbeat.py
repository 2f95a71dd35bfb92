"""Fail-stop and hang detection through the job's store.

Responsible for: a daemon watchdog thread on every rank that reads every other rank's heartbeat
(``prefix + str(rank)`` = ``"<time>:<progress>[:mark]"``, one ``multi_get`` per poll) and reports

* **dead** ranks: no new heartbeat for ``timeout_s`` (the process or its node is gone), plus how
  late the host has recently let heartbeats run, judged by
  ``resihp_ext.detection.host_lateness.judge_heartbeats_under_load``;
* **dead** at once: a rank whose beacon wrote the ``dead`` mark (its process is gone);
* **hung** ranks: heartbeat alive but the training progress they publish (``beat(progress)``,
  called at each iteration boundary) stopped for ``hang_timeout_s`` while other ranks moved on,
  judged by ``hang_rules.judge_progress``, with the same allowance for a host running late; a rank
  compiling a ``torch.compile`` graph (``compile_watch``) publishes so, and is not hung while its
  compile lasts up to ``compile_timeout_s``;
* **hung** at once: a rank whose beacon wrote the ``stopped`` mark (stopped by a signal; it cannot
  progress until continued, and nobody waits for that);
* **hung** in seconds: a rank working outside any collective without progress while another waits
  in one, each rank publishing what its training thread is doing (``hang_rules``).

This rank's own heartbeat is published by its beacon (``heartbeat_beacon``), a child process
that no lock of this one can delay; without a beacon the watchdog thread publishes it.

A death stalls the survivors too: each sits in a collective with the dead rank (or with a rank
that does) until the collective times out. So once a monitor has seen a death, stall clocks start
again at that moment and run ``failure_grace_s`` longer, and a rank that has reached its recovery
code (``mark_recovering()``) is never called hung: it is alive and doing what it should, and it
counts as ahead of every rank still training, so a rank that never gets there is named.

A rank that stops its monitor cleanly (``stop()``) publishes an exit mark, so finishing training
first is never mistaken for dying. Survivors that leave a rank behind ``evict()`` it: the evicted
rank's own watchdog sees the mark and calls ``on_evicted``, so a hung process can be fenced (it
still holds its device and sockets) instead of lingering after the job re-formed without it.

It must never touch a process group or the store client of one: the watchdog uses its own
TCPStore connection (``connect_store`` / ``HeartbeatMonitor.from_env``), so a collective that is
stuck, or the process group's own store traffic, can neither delay nor be delayed by heartbeats.
It only reports; what to do about a dead or hung rank is the caller's decision.

Heartbeat times are wall-clock (``time.time()``) seconds, compared across ranks: on one node that
is one clock; across nodes the clocks must agree to well within ``timeout_s`` (NTP does).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from megatron.resihp import compile_watch, hang_rules
from megatron.resihp.hang_rules import judge_progress
from megatron.resihp.heartbeat_beacon import (DEAD_MARK, FENCED_MARK, MARK_COMPILING, MARK_EXIT, MARK_IO, MARK_NONE,
                                              MARK_RECOVERING, MARK_TEXT, MARK_WAITING, STOPPED_MARK, Beacon,
                                              heartbeat_text, read_heartbeat)
from megatron.resihp.logging_utils import rank_name, ranks_name
from resihp_ext.detection.host_lateness import HostLateness, judge_heartbeats_under_load

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.2
DEFAULT_TIMEOUT_S = 1.5
# The store is lost once it has not answered for this many heartbeat timeouts (a store that is
# only slow answers late, and does not fail: a host's death resets the connection at once).
STORE_LOSS_TIMEOUTS = 2
# How long one store operation of the watchdog may block.
STORE_OP_TIMEOUT_S = 10.0
DEFAULT_PREFIX = "resihp/hb/"
# Ranks start their monitors seconds apart (imports, model build); one not seen yet is only
# declared dead after this long.
DEFAULT_STARTUP_GRACE_S = 60.0
# A host that ran late is expected to run late again for a while: a lateness seen is allowed for
# this long. At most LATENESS_CAP_TIMEOUTS heartbeat timeouts are allowed, so a rank lost with its
# beacon (a lost node) is still named on a host that is always late.
LATENESS_WINDOW_S = 30.0
LATENESS_CAP_TIMEOUTS = 4.0
_EXIT_MARK = MARK_TEXT[MARK_EXIT]
_RECOVERING_MARK = MARK_TEXT[MARK_RECOVERING]
_STATE_MARKS = {hang_rules.WAITING: MARK_WAITING, hang_rules.IO: MARK_IO, hang_rules.WORKING: MARK_NONE,
                hang_rules.COMPILING: MARK_COMPILING}
_MARK_STATES = {MARK_TEXT[mark]: state for state, mark in _STATE_MARKS.items()}
# Iteration times a monitor keeps to judge how long a rank may work while others wait.
_TIMED_ITERATIONS = 20

RankCallback = Callable[[frozenset[int], float], None]


def connect_store(host: str | None = None, port: int | None = None, timeout_s: float = STORE_OP_TIMEOUT_S):
    """A new TCPStore client connection to the job's store (``MASTER_ADDR``/``MASTER_PORT``).

    Args:
        host: store address; ``MASTER_ADDR`` if None.
        port: store port; ``MASTER_PORT`` if None.
        timeout_s: how long one store operation may block.

    Returns:
        A ``torch.distributed.TCPStore`` client of its own.
    """
    from torch.distributed import TCPStore

    host = host or os.environ.get("MASTER_ADDR")
    port_text = port if port is not None else os.environ.get("MASTER_PORT")
    if not host or port_text is None:
        raise ValueError("heartbeat store: MASTER_ADDR and MASTER_PORT must be set (launch with torchrun or "
                         "scripts/launch_local.py), or pass host= and port=")
    return TCPStore(host, int(port_text), is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


class HeartbeatMonitor:
    """Publishes this rank's heartbeat and watches everyone else's, on a daemon thread.

    Args:
        store: a store client used by the watchdog thread only (see ``connect_store``); never the
            process group's own client.
        rank: this rank.
        world_size: number of ranks.
        interval_s: seconds between two heartbeats (and two polls).
        timeout_s: a rank whose heartbeat is older than this is dead.
        on_dead: called as ``on_dead(dead_ranks, now)`` on the watchdog thread each time the set
            of dead ranks grows, with the whole set and the time of the decision.
        prefix: key prefix; use a fresh one after the job re-forms.
        hang_timeout_s: a rank whose progress stood still this long while others moved on is hung;
            None disables hang detection. Choose several iteration times.
        on_hang: like ``on_dead``, for the set of hung ranks.
        on_evicted: called once, on the watchdog thread, when another rank ``evict()``s this one.
        startup_grace_s: how long a rank may take to publish its first heartbeat.
        failure_grace_s: after a death, how long survivors may stall before a hang is counted
            (the collective timeout: that is how long a survivor blocked on the dead rank waits).
        clock: wall clock shared by all ranks (tests may pass their own).
        identity: the launch rank of every rank of this world (``RunState.identity``), which the
            warnings name ranks by; None: the world is the launch one.
        beacon: this process's ``heartbeat_beacon.Beacon``; when given (and alive), it publishes
            this rank's heartbeat and the watchdog thread only reads the others'. Without one the
            watchdog thread publishes, and a training thread holding the GIL delays it.
        hang_iters: a rank working without progress for this many of this rank's median
            iterations (at least ``blocking_floor_s``) while another waits in a collective is hung
            (``hang_rules``); 0 turns that rule off.
        blocking_floor_s: the least time for that rule (default: 5 heartbeat timeouts).
        compile_timeout_s: how long a rank's compile may last before its stall counts (None: a
            compile is work like any other).
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_dead: RankCallback | None = None,
        prefix: str = DEFAULT_PREFIX,
        *,
        hang_timeout_s: float | None = None,
        on_hang: RankCallback | None = None,
        on_evicted: Callable[[], None] | None = None,
        startup_grace_s: float = DEFAULT_STARTUP_GRACE_S,
        failure_grace_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        beacon: Beacon | None = None,
        identity: Sequence[int] | None = None,
        hang_iters: float = 0.0,
        blocking_floor_s: float | None = None,
        compile_timeout_s: float | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"heartbeat: rank must be in 0..{world_size - 1}, got {rank}")
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"--resihp-heartbeat-interval-s must be > 0 and below --resihp-heartbeat-timeout-s "
                             f"({timeout_s}), got {interval_s}")
        if hang_timeout_s is not None and hang_timeout_s <= timeout_s:
            raise ValueError(f"--resihp-hang-timeout-s must exceed the heartbeat timeout ({timeout_s}), got "
                             f"{hang_timeout_s}; a hang is judged over several iterations")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.prefix = prefix
        self.startup_grace_s = startup_grace_s
        self.failure_grace_s = failure_grace_s
        self._on_dead = on_dead
        self._on_hang = on_hang
        self._on_evicted = on_evicted
        self._evicted = False
        self._clock = clock
        self.beacon = beacon
        self.identity = None if identity is None else tuple(identity)
        self._progress = -1  # written by the training thread, read by the watchdog (an int: atomic)
        self._recovering = False  # likewise
        self.hang_iters = hang_iters
        self.blocking_floor_s = 5 * timeout_s if blocking_floor_s is None else blocking_floor_s
        self.compile_timeout_s = compile_timeout_s
        self._compiling: frozenset[int] = frozenset()  # ranks compiling within compile_timeout_s
        self._told_compiling = False  # this rank's current compile passed the hang timeout, and said so
        self._state = hang_rules.WORKING  # this rank's training thread, as the watchdog last saw it
        self._mark_lock = threading.Lock()  # the beacon's mark: recovering wins over the watchdog's state
        self._states: dict[int, tuple[str, float]] = {}  # rank -> (state, since when without a break)
        self._iteration_s: list[float] = []  # this rank's latest iteration times in this world
        self._failure_seen_at: float | None = None
        self._recovering_ranks: set[int] = set()
        self._lock = threading.Lock()
        self._dead: frozenset[int] = frozenset()
        self._silent: frozenset[int] = frozenset()  # dead by the timeout: no beacon said so
        self._hung: frozenset[int] = frozenset()
        self._exited: frozenset[int] = frozenset()
        self._last_beat: dict[int, float] = {}
        self._seen_progress: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._store_failing_since: float | None = None  # first of the store errors in a row
        self._store_lost = False
        self._lateness = HostLateness(interval_s, LATENESS_WINDOW_S, LATENESS_CAP_TIMEOUTS * timeout_s)
        self._poll_lateness = 0.0  # how late the current poll woke, by this thread's own clock

    @classmethod
    def from_env(cls, **kwargs) -> HeartbeatMonitor:
        """A monitor for this process from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, on its own store client."""
        rank = kwargs.pop("rank", None)
        world_size = kwargs.pop("world_size", None)
        try:
            rank = int(os.environ["RANK"]) if rank is None else rank
            world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        except KeyError as err:
            raise ValueError(f"heartbeat: {err.args[0]} is not set; launch with torchrun or scripts/launch_local.py, "
                             "or pass rank= and world_size=") from None
        return cls(connect_store(), rank, world_size, **kwargs)

    # ------------------------------------------------------------------ training-thread API

    def beat(self, progress: int) -> None:
        """Publish training progress (e.g. the iteration number); call at each iteration boundary.

        Only records the value: the watchdog thread writes it with the next heartbeat, so the
        training loop never waits on the store.
        """
        self._progress = int(progress)
        if self.beacon is not None:
            self.beacon.set_progress(self._progress)

    def mark_recovering(self) -> None:
        """Tell the other ranks this one has left training for its recovery code.

        From the next heartbeat on, nobody judges this rank hung (it is alive and busy recovering);
        it can still be judged dead.
        """
        with self._mark_lock:
            self._recovering = True
            if self.beacon is not None:
                self.beacon.set_mark(MARK_RECOVERING)

    def start(self) -> HeartbeatMonitor:
        """Publish the first heartbeat and start the watchdog thread."""
        if self._thread is not None:
            raise RuntimeError("HeartbeatMonitor.start() called twice")
        self._started_at = self._clock()
        if self.beacon is not None:
            self.beacon.point_at(self._key(self.rank), self._evicted_key(self.rank))
            self.beacon.set_progress(self._progress)
        self._publish(self._started_at)
        self._thread = threading.Thread(target=self._run, name=f"resihp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and mark this rank as exited cleanly (others will not call it dead)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5 * self.interval_s, 5.0))
        if self.beacon is not None and self._beacon_alive():
            self.beacon.set_mark(MARK_EXIT)
            if self.beacon.wait_published(max(5 * self.interval_s, 2.0)):
                return
        try:
            self._publish(self._clock(), exited=True, direct=True)
        except Exception as err:  # the store may be gone at shutdown; nothing left to tell
            logger.warning("heartbeat: could not publish exit of rank %d: %s", self.rank, err)

    def evict(self, ranks) -> None:
        """Mark ranks as left behind by the survivors; their watchdogs call ``on_evicted``."""
        for r in ranks:
            self.store.set(self._evicted_key(r), "1")

    @property
    def store_failing(self) -> bool:
        """The job's store did not answer this rank's watchdog at its last try."""
        return self._store_failing_since is not None

    @property
    def store_lost(self) -> bool:
        """The job's store has not answered for ``STORE_LOSS_TIMEOUTS`` heartbeat timeouts: its host
        is gone, and without it no failure can be named or recovered from."""
        return self._store_lost

    @property
    def silent_ranks(self) -> frozenset[int]:
        """Dead ranks named by the heartbeat timeout alone (their beacon went too: a lost node)."""
        with self._lock:
            return self._silent

    @property
    def dead_ranks(self) -> frozenset[int]:
        with self._lock:
            return self._dead

    @property
    def compiling_ranks(self) -> frozenset[int]:
        """Ranks compiling a graph now, for no longer than ``compile_timeout_s``: not hung however
        long their progress stood still."""
        with self._lock:
            return self._compiling

    @property
    def hung_ranks(self) -> frozenset[int]:
        with self._lock:
            return self._hung

    @property
    def exited_ranks(self) -> frozenset[int]:
        """Ranks that stopped their monitor cleanly."""
        with self._lock:
            return self._exited

    @property
    def recovering_ranks(self) -> frozenset[int]:
        """Ranks that reached their recovery code in this world (``mark_recovering``), this one too."""
        with self._lock:
            return frozenset(self._recovering_ranks) | ({self.rank} if self._recovering else frozenset())

    @property
    def alive_ranks(self) -> frozenset[int]:
        """Ranks judged neither dead nor hung (exited ranks included): the ones a recovery keeps."""
        with self._lock:
            return frozenset(range(self.world_size)) - self._dead - self._hung

    # ------------------------------------------------------------------ watchdog thread

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _evicted_key(self, rank: int) -> str:
        return f"{self.prefix}evicted/{rank}"

    def _beacon_alive(self) -> bool:
        return self.beacon is not None and self.beacon.alive()

    def _publish(self, now: float, exited: bool = False, direct: bool = False) -> None:
        if not direct and self._beacon_alive():
            return  # the beacon publishes, on time whatever holds this process's GIL
        mark = _EXIT_MARK if exited else _RECOVERING_MARK if self._recovering else MARK_TEXT[_STATE_MARKS[self._state]]
        self.store.set(self._key(self.rank), heartbeat_text(now, self._progress, mark))

    def _observe_self(self) -> None:
        """What this rank's training thread does now, for its heartbeat (not while it recovers)."""
        state = hang_rules.main_thread_state() if self.hang_iters > 0 else hang_rules.WORKING
        watching = self.compile_timeout_s is not None and compile_watch.install()
        if state != hang_rules.WAITING and watching and compile_watch.compiling():
            state = hang_rules.COMPILING
        with self._mark_lock:
            if state == self._state or self._recovering:
                return
            self._state = state
            if self.beacon is not None:
                self.beacon.set_mark(_STATE_MARKS[state])

    def _run(self) -> None:
        next_at = self._clock()
        while not self._stop.is_set():
            try:
                self._observe_self()
                self._publish(self._clock())
                self._poll()
                self._store_failing_since = None
            except Exception as err:  # a store hiccup must not end the watchdog
                now = self._clock()
                if self._store_failing_since is None:
                    self._store_failing_since = now
                    logger.warning("heartbeat: store operation failed on rank %d: %s",
                                   self.rank, str(err).splitlines()[0])
                elif not self._store_lost and now - self._store_failing_since > STORE_LOSS_TIMEOUTS * self.timeout_s:
                    self._store_lost = True
            next_at += self.interval_s
            # Fixed cadence, but never a burst of catch-up beats after a stall.
            next_at = max(next_at, self._clock())
            self._stop.wait(next_at - self._clock())
            self._poll_lateness = self._clock() - next_at

    def _read(self, ranks: list[int]) -> dict[int, str]:
        # get() blocks until a key exists, so unseen ranks are checked first; once every rank has
        # beaten, one multi_get per poll reads all of them.
        seen = [r for r in ranks if r in self._last_beat]
        fresh = [r for r in ranks if r not in self._last_beat and self.store.check([self._key(r)])]
        ranks = seen + fresh
        if not ranks:
            return {}
        keys = [self._key(r) for r in ranks]
        values = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else [self.store.get(k) for k in keys]
        return {r: v.decode() if isinstance(v, bytes) else str(v) for r, v in zip(ranks, values)}

    def _poll(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank and r not in self._dead and r not in self._exited]
        # The clock is read before the store: a value read afterwards is at least that fresh, so a
        # stall of this thread between the two can never make a live rank look late.
        now = self._clock()
        # This rank's own heartbeat is read too: when even it is stale, the host or the store
        # stood still, and no other rank is to blame.
        values = self._read(others + [self.rank])
        own_beat = values.pop(self.rank, None)
        beats = {}
        if own_beat is not None:
            beats[self.rank] = self._last_beat[self.rank] = read_heartbeat(own_beat)[0]
        exited, marked_dead, fenced, stopped = set(), set(), set(), set()
        for r, text in values.items():
            beat_at, progress, mark = read_heartbeat(text)
            if mark == _EXIT_MARK:
                exited.add(r)
                continue
            if mark in (DEAD_MARK, FENCED_MARK):  # its beacon saw it die
                marked_dead.add(r)
                if mark == FENCED_MARK:
                    fenced.add(r)
                continue
            if mark == _RECOVERING_MARK:
                self._recovering_ranks.add(r)
            self._note_state(r, _MARK_STATES.get(mark, hang_rules.WORKING), now)
            if mark == STOPPED_MARK:
                stopped.add(r)
            self._last_beat[r] = beat_at
            beats[r] = beat_at
            if self._seen_progress.get(r, (None, 0.0))[0] != progress:
                self._seen_progress[r] = (progress, now)
        if not self._evicted and self.store.check([self._evicted_key(self.rank)]):
            self._evicted = True
            logger.warning("heartbeat: %s was evicted by the other ranks", self._name(self.rank))
            if self._on_evicted is not None:
                self._on_evicted()
        own = self._seen_progress.get(self.rank)
        if own is None or own[0] != self._progress:
            if own is not None and self._progress > own[0] >= 0:
                self._iteration_s = [*self._iteration_s[-(_TIMED_ITERATIONS - 1):], now - own[1]]
            self._seen_progress[self.rank] = (self._progress, now)
        self._note_state(self.rank, self._state, now)

        # A rank never seen yet counts as having beaten at the end of its start-up grace.
        last_beat = {r: self._last_beat.get(r, self._started_at + self.startup_grace_s - self.timeout_s)
                     for r in others if r not in exited}
        self._lateness.beats(now, beats)
        self._lateness.poll(now, self._poll_lateness)
        allowance = self._lateness.allowance(now)
        dead = judge_heartbeats_under_load(now, {r: t for r, t in last_beat.items() if r not in marked_dead},
                                           self.timeout_s, allowance,
                                           max(beats.values()) if beats else None) | frozenset(marked_dead)
        if dead and self._failure_seen_at is None:
            self._failure_seen_at = now
        hung = frozenset(stopped) - dead
        compiling = overcompiled = frozenset()
        if self.compile_timeout_s is not None:
            compiling_since = {r: since for r, (state, since) in self._states.items() if state == hang_rules.COMPILING}
            compiling = frozenset(r for r, since in compiling_since.items() if now - since <= self.compile_timeout_s)
            overcompiled = frozenset(compiling_since) - compiling
        self._tell_compiling(now)
        if self.hang_timeout_s is not None:
            gone = dead | self._dead | exited | self._exited
            watched = {r: p for r, p in self._seen_progress.items() if r not in gone}
            recovering = frozenset(self._recovering_ranks) | ({self.rank} if self._recovering else set())
            hung |= judge_progress(now, watched, self.hang_timeout_s + allowance, recovering,
                                   self._failure_seen_at, self.failure_grace_s, compiling) - {self.rank}
        blocking = frozenset()
        after_s = hang_rules.blocking_after_s(self._iteration_s, self.hang_iters, self.blocking_floor_s)
        if after_s is not None and not dead and self._failure_seen_at is None:
            # After a death the others wait on the dead rank, not on whoever works.
            gone = self._dead | exited | self._exited
            training = {r: since for r, (_, since) in self._seen_progress.items()
                        if r not in gone and r not in self._recovering_ranks and not (r == self.rank and self._recovering)}
            blocking = hang_rules.judge_blocking(now, training, self._states, after_s + allowance) - {self.rank}
            hung |= blocking

        with self._lock:
            self._exited = self._exited | exited
            # A rank that dies after being judged hung, or fenced after an eviction, is no news:
            # the decision to leave it out was made already.
            new_dead = dead - self._dead - self._hung - fenced
            self._dead = self._dead | dead
            self._silent = self._silent | (new_dead - marked_dead)
            new_hung = hung - self._hung - self._dead
            self._hung = (self._hung | hung) - self._dead
            # A rank's last mark outlives it: one that died or left while compiling compiles no more.
            self._compiling = compiling - self._dead - self._hung - self._exited
            dead_now, hung_now = self._dead, self._hung
        if new_dead:
            gone, silent = sorted(new_dead & marked_dead), sorted(new_dead - marked_dead)
            logger.warning("heartbeat: %s sees %s dead (%s)", self._name(self.rank), self._names(new_dead), "; ".join(
                ([f"{self._launch(gone)}: process exited"] if gone else []) +
                ([f"{self._launch(silent)}: no heartbeat for {self.timeout_s + allowance:.1f} s"
                  + (f" (the host ran up to {allowance:.1f} s late)" if allowance >= 0.1 else "")] if silent else [])))
            self._notify(self._on_dead, dead_now, now, "on_dead")
        if new_hung:
            logger.warning("heartbeat: %s sees %s hung (%s)", self._name(self.rank), self._names(new_hung), "; ".join(
                ([f"{self._launch(new_hung & stopped)}: stopped by a signal"] if new_hung & stopped else []) +
                ([f"{self._launch(new_hung & blocking - stopped)}: working without progress for "
                  f"{after_s + allowance:.1f} s while {self._waiting_names(now)} waited in a collective"]
                 if new_hung & blocking - stopped else []) +
                ([f"{self._launch(new_hung & overcompiled)}: compiling for over {self.compile_timeout_s:g} s "
                  f"(--resihp-compile-timeout-s)"] if new_hung & overcompiled else []) +
                ([f"{self._launch(new_hung - stopped - blocking - overcompiled)}: no progress for "
                  f"{self.hang_timeout_s + allowance:.1f} s"] if new_hung - stopped - blocking - overcompiled else [])))
            self._notify(self._on_hang, hung_now, now, "on_hang")

    def _note_state(self, rank: int, state: str, now: float) -> None:
        previous = self._states.get(rank, (None, 0.0))[0]
        if previous != state:
            self._states[rank] = (state, now)
            if previous == hang_rules.COMPILING and rank != self.rank and rank in self._seen_progress:
                # A compile is work: the rank's stall clock starts again when it ends. (This rank's
                # own clock times its iterations, and no rule of this monitor judges this rank.)
                self._seen_progress[rank] = (self._seen_progress[rank][0], now)

    def _tell_compiling(self, now: float) -> None:
        """Say once per compile of this rank that it outlasts the hang timeout, and until when that is no hang."""
        state, since = self._states.get(self.rank, (None, now))
        if state != hang_rules.COMPILING:
            self._told_compiling = False
            return
        stalled_since = self._seen_progress.get(self.rank, (None, since))[1]
        if (self._told_compiling or self.hang_timeout_s is None or self.compile_timeout_s is None
                or now - stalled_since <= self.hang_timeout_s):
            return
        self._told_compiling = True
        logger.warning("heartbeat: %s has compiled a torch.compile graph for %.1f s, its progress standing still "
                       "past the hang timeout (%.4g s): not hung while the compile lasts up to "
                       "--resihp-compile-timeout-s (%.4g s)", self._name(self.rank), now - since,
                       self.hang_timeout_s, self.compile_timeout_s)

    def _waiting_names(self, now: float) -> str:
        waiting = sorted(r for r, (state, _) in self._states.items() if state == hang_rules.WAITING)
        return self._names(frozenset(waiting)) if waiting else "others"

    def _name(self, rank: int) -> str:
        return rank_name(rank, self.identity)

    def _names(self, ranks) -> str:
        return ranks_name(ranks, self.identity)

    def _launch(self, ranks) -> list[int]:
        """``ranks`` by launch rank, for the details of a warning that names launch ranks."""
        return [r if self.identity is None else self.identity[r] for r in sorted(ranks)]

    def _notify(self, callback: RankCallback | None, ranks: frozenset[int], now: float, name: str) -> None:
        if callback is None:
            return
        try:
            callback(ranks, now)
        except Exception:  # the watchdog must outlive a faulty callback
            logger.exception("heartbeat: %s callback raised on rank %d", name, self.rank)
