"""The store protocols of in-place adaptation, one function per step.

    await_failed_ranks -> agree_on_progress -> agree_on_plan -> [join_moves_world] -> meet_and_reform
        -> (rebuild: reconfigure) -> resume
    spares_may_go / spares_stay: whether a plan's spares leave, or stay for the next attempt
    agree_on_commit: one answer for every member of a layout change (commit or go back)

Responsible for carrying out a ``SurvivorPlan`` (``resihp_ext/planner/survivors.py``) in the
surviving processes: the plan is decided once, by the lowest surviving rank, and published through
the job's store, so every survivor applies the same one. State never comes from a checkpoint when
a replica survives whole or can be rebuilt from intact stage groups: every kept rank already holds
its stage's shard, model and optimizer, and copies them into the objects rebuilt on the new
groups. A stage group that the plan moves to another stage is the one exception: its new stage's
state comes point-to-point from surviving holders, in a world of every survivor (``join_moves_world``),
before spares leave. Nothing here decides what to keep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from megatron.resihp.failure_origin import PeerFailed
from megatron.resihp.parallel_state_patch import reform_world
from resihp_ext.layout import Layout
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.survivors import SurvivorPlan, plan_survivors


def await_failed_ranks(monitor, wait_s: float, settle_s: float = 0.0, poll_s: float = 0.05,
                       recovering: frozenset[int] | None = None) -> frozenset[int]:
    """Ranks the heartbeat monitor names dead or hung, waiting up to ``wait_s`` for a name.

    Once one is named, a further ``settle_s`` lets ranks that failed together (a node, a switch)
    be named too, so the plan is made once for all of them rather than once per name. None is
    named once the job's store is lost, nor once every rank of ``recovering`` (when given) has
    reached its recovery code alive: then nobody failed. While a rank of ``recovering`` that is not
    there yet compiles a graph (``monitor.compiling_ranks``), the wait lasts ``wait_s`` past its compile.
    """
    deadline = time.monotonic() + wait_s
    while True:
        failed = monitor.dead_ranks | monitor.hung_ranks
        if failed or monitor.store_lost or time.monotonic() > deadline:
            break
        if recovering is not None:
            if recovering <= monitor.recovering_ranks:
                break  # a rank in its recovery is never named hung, and one that dies now fails the re-form
            if (recovering - monitor.recovering_ranks) & monitor.compiling_ranks:
                deadline = time.monotonic() + wait_s  # on its way, once compiled; named hung if it never comes
        time.sleep(poll_s)
    if failed and settle_s > 0:
        time.sleep(settle_s)
        failed = monitor.dead_ranks | monitor.hung_ranks
    return frozenset(failed)


def wait_for_keys(store, keys: list[str], wait_s: float, stop=lambda: None, poll_s: float = 0.02) -> None:
    """Poll until every key is in the job store.

    Polls rather than ``store.wait()``: a blocking wait holds the GIL, which silences this
    process's heartbeat thread and gets it declared dead by the others.

    Args:
        stop: called between polls; a non-empty reason (say, which ranks failed) ends the wait.
            The keys are read once more first, so a key written just before the reason arose counts.

    Raises:
        PeerFailed: ``stop`` gave a reason while a key was still missing.
        TimeoutError: a key was still missing after ``wait_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        reason = stop()
        if reason or time.monotonic() > deadline:
            if store.check(keys):
                return
            if reason:
                raise PeerFailed(reason)
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"no {missing[0]!r} in the job store after {wait_s:.0f} s "
                               f"({len(missing)} of {len(keys)} keys missing)")
        time.sleep(poll_s)


def agree_on_commit(store, prefix: str, members: int, finished: bool, stop: Callable[[], str | None],
                    wait_s: float, poll_s: float = 0.02) -> bool:
    """Whether all ``members`` finished a step (True) or it is abandoned (False): one answer for all.

    Each member that finished adds 1 to ``<prefix>finished``, then waits. The answer lives in one
    key, ``<prefix>decision``, written once by an atomic compare-and-set: "commit" by a member that
    sees the count reach ``members``, "abandon" by one that did not finish, sees a failure
    (``stop`` gives a reason) or passes the deadline first. Every member returns what that key
    holds, never what it saw itself, so members agree whoever dies at whatever point. A member
    that finished and then died counts as finished, as it would have if it had died a moment later.
    """
    count_key, decision_key = f"{prefix}finished", f"{prefix}decision"
    if finished:
        store.add(count_key, 1)
    deadline = time.monotonic() + wait_s
    while not store.check([decision_key]):
        if store.add(count_key, 0) == members:
            store.compare_set(decision_key, "", "commit")
        elif not finished or stop() or time.monotonic() > deadline:
            store.compare_set(decision_key, "", "abandon")
        else:
            time.sleep(poll_s)
    return store.get(decision_key) == b"commit"


def agree_on_progress(store, generation: int, rank: int, survivors: list[int], resume_at: int,
                      wait_s: float, stop: Callable[[], str | None] = lambda: None) -> dict[int, int]:
    """Every survivor's first iteration not done, as each published it for world ``generation``.

    A failure as an optimizer step begins can leave survivors an update apart: replicas whose
    step needed no collective with the failed rank stepped, the others did not. The caller
    compares; every survivor reads the same answers.

    Raises:
        PeerFailed, TimeoutError: as ``wait_for_keys``, when a survivor never published.
    """
    prefix = f"resihp/gen{generation}/progress/"
    store.set(f"{prefix}{rank}", str(resume_at))
    wait_for_keys(store, [f"{prefix}{r}" for r in survivors], wait_s, stop)
    return {r: int(store.get(f"{prefix}{r}")) for r in survivors}


def plan_key(generation: int) -> str:
    """Where the plan of world ``generation``'s recovery is published (standbys read it too)."""
    return f"resihp/gen{generation}/plan"


def agree_on_plan(store, generation: int, rank: int, layout: Layout, failed: frozenset[int],
                  describe_preferred, wait_s: float, move_state: bool = True,
                  hw: HardwareModel | None = None, health: Health | None = None,
                  standbys: Callable[[], tuple[int, ...]] = tuple,
                  shared: Callable[[SurvivorPlan], dict] = lambda plan: {},
                  sharded_optimizer: bool = False, part_copies: bool = False, keep_tp: bool = False,
                  tp_descending: bool = False, replica_counts: frozenset[int] | None = None,
                  uniform_tp: bool = False) -> tuple[SurvivorPlan, frozenset[int], dict]:
    """The lowest surviving rank decides and publishes; everyone reads the same plan back.

    ``health``: the fail-slow verdicts acted on so far (``layout``'s ranks); the quotas follow them.
    On the leader only, ``standbys()`` gives the standbys the plan may take back (ranks after the
    layout's, ``plan_survivors``'s ``standbys``), and ``shared(plan)`` what is published beside it.

    Returns:
        (the plan, the failed ranks it was made for, everything published: ``preferred``, the
        joint planner's preferred plan, and what ``shared`` added).
    """
    key = plan_key(generation)
    leader = min(set(layout.world_ranks) - failed)
    if rank == leader:
        plan = plan_survivors(layout, failed, move_state=move_state, hw=hw, health=health, standbys=standbys(),
                              sharded_optimizer=sharded_optimizer, part_copies=part_copies, keep_tp=keep_tp,
                              tp_descending=tp_descending, replica_counts=replica_counts, uniform_tp=uniform_tp)
        store.set(key, json.dumps({**shared(plan), "plan": plan.to_dict(), "failed": sorted(failed),
                                   "preferred": describe_preferred(failed)}))
    wait_for_keys(store, [key], wait_s)
    published = json.loads(store.get(key))
    return SurvivorPlan.from_dict(published["plan"]), frozenset(published["failed"]), published


def meet_and_reform(store, label: str, new_rank: int, world_size: int, backend: str, timeout_s: float,
                    stop: Callable[[], str | None] = lambda: None, met: Callable[[], None] = lambda: None,
                    connect_s: float | None = None) -> None:
    """Every member writes ``resihp/gen<label>/joining/<new_rank>`` and polls for all of them before
    ``reform_world``; only then does the GIL-holding rendezvous of ``init_process_group`` start.

    Members reach a re-formed world at different times: one fails fast when a peer it sends to
    dies, another waits out a timeout. Meeting in the store first keeps every member's heartbeat
    thread running, and ``stop`` (a failure the heartbeats name among the members) makes them all
    give up on a world that can no longer form together, rather than each on its own timeout.

    ``met`` runs once every member has arrived, just before the rendezvous, which ``connect_s``
    bounds (``parallel_state_patch.reform_world``'s ``connect_timeout``).

    Raises:
        RuntimeError: ``stop`` gave a reason before every member arrived (the old world stands), or
            the rendezvous failed (the old world is gone: ``dist.is_initialized()`` is False).
        TimeoutError: a member was missing after three collective timeouts.
    """
    prefix = f"resihp/gen{label}/joining/"
    store.set(f"{prefix}{new_rank}", "1")
    wait_for_keys(store, [f"{prefix}{r}" for r in range(world_size)], 3 * timeout_s, stop)
    met()
    reform_world(store, new_rank, world_size, label, backend=backend, timeout=timeout_s, connect_timeout=connect_s)
    store.add(_formed_key(label), 1)


def _formed_key(label: str) -> str:
    return f"resihp/gen{label}/formed"


def _spares_key(generation: int) -> str:
    return f"resihp/gen{generation}/spares"


def spares_may_go(store, generation: int, world_size: int, stop: Callable[[], str | None], wait_s: float,
                  poll_s: float = 0.1) -> bool:
    """On a spare of world ``generation``'s plan: whether it may leave, once that world formed.

    Until every member is through its rendezvous a spare still holds its shard as it was when the
    failure struck, and if a member fails first, the next attempt's plan may need it: with one
    replica kept and the others' ranks spares, a kept rank lost as the world forms has its shard
    nowhere else. So the answer is "go" once all ``world_size`` members formed the world, and
    "stay" (this spare plans again with the survivors, as one of them) once ``stop`` names a
    failure among them or ``wait_s`` passes first. One key holds it, written once by an atomic
    compare-and-set, which the members read too (``spares_stay``), so spares and members agree.
    Without the store no world can form again: the spare goes, and standing by finds the loss.
    Spares poll at ``poll_s``, slower than members do: nobody waits for a spare that goes, and a
    broken replica of a large job has many spares asking the one store at once.
    """
    key = _spares_key(generation)
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([key]):
            if store.add(_formed_key(str(generation)), 0) >= world_size:
                store.compare_set(key, "", "go")
            elif stop() or time.monotonic() > deadline:
                store.compare_set(key, "", "stay")
            else:
                time.sleep(poll_s)
        return store.get(key) == b"go"
    except RuntimeError:  # the store is gone (torch's store errors are RuntimeErrors): no attempt can follow
        return True


def spares_stay(store, generation: int) -> bool:
    """On a member of world ``generation`` that failed to form or fill it: whether the plan's spares
    stayed to plan again as survivors (``spares_may_go``: the same answer every rank reads)."""
    key = _spares_key(generation)
    store.compare_set(key, "", "stay")
    return store.get(key) == b"stay"


def join_moves_world(store, generation: int, rank: int, survivors: list[int], backend: str, timeout_s: float,
                     stop: Callable[[], str | None] = lambda: None, joined: Callable[[], None] = lambda: None,
                     connect_s: float | None = None) -> None:
    """Every survivor (spares too: they may hold what a moved group needs) joins one world, in which
    the plan's moves and the optimizer's parts are sent (``reconfigure``).

    The world uses its own store prefix (``gen<N>moves``), so the kept ranks' next world, under
    ``gen<N>``, cannot meet it by mistake. ``joined`` runs once this rank is in that world.
    """
    meet_and_reform(store, f"{generation}moves", survivors.index(rank), len(survivors), backend, timeout_s, stop,
                    connect_s=connect_s)
    joined()
