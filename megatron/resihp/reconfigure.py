"""The one life cycle of a layout change: the only code that installs a layout after start-up.

Responsible for carrying out a ``LayoutChange`` that a driver asked for (fail-slow re-plan:
``fail_slow_replan.py``; fail-stop recovery: ``fail_stop_recovery.py``; standby readmission:
``standby.py``), always in the same steps::

    [world]  SAME: keep it | SHRINK: move state out (to spares taken back too), leavers leave, re-form
             | GROW: form the grown world
    build groups -> install -> rebuild model, DDP, optimizer -> move state -> agree -> commit

and for rolling one back, in one place: until the change commits, the state it started from
(the ``RunState`` passed in) is whole on every member, because moves only read the old objects.
A member that fails part-way makes every member raise ``ChangeFailed`` carrying the state they are
all back on (the old layout, in whichever world they are now in), from which the fail-stop
recovery starts. The agreement (``recovery.agree_on_commit``) gives every member one answer
whoever dies when. A SHRINK change does not agree: its members have left the old world already,
and a failure surfaces as ``ChangeFailed`` to the recovery, which plans again without the rank
the heartbeats name.

What to change to is never decided here; nothing here writes onto ``args``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Protocol

import torch.distributed as dist

from megatron.resihp import recovery
from megatron.resihp.failure_origin import PeerFailed
from megatron.resihp.layer_sync import LayoutGradSync
from megatron.resihp.logging_utils import log_line, rank_name
from megatron.resihp.training_objects import TrainingObjects
from megatron.resihp.optimizer_parts import (
    PartCopies, StagedParts, is_distributed, position_parts, regather, set_back_adam_steps, stage_parts, whole_part,
    whole_states, write_parts,
)
from megatron.resihp.parallel_state_patch import build_groups, install, message_group, teardown
from megatron.resihp.reshard import (
    apply_transfers, carry_schedule, load_loss_scale_state, loss_scale_state, stage_transfers, unstage_transfers,
)
from megatron.resihp.run_state import RunState
from resihp_ext.layout import Layout


class World(enum.Enum):
    """How the world (the processes and their ranks) changes with the layout."""

    SAME = "same"  # the same processes keep their ranks
    SHRINK = "shrink"  # fewer processes: state moves in a world of the old members, then the rest re-form
    GROW = "grow"  # joiners come in: the grown world forms first (working ranks keep their numbers)


class ChangeFailed(PeerFailed):
    """A member failed before the change committed; every member is back on ``run``."""

    def __init__(self, message: str, run: RunState):
        super().__init__(message)
        self.run = run


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """What a driver asks for.

    Attributes:
        kind: "replan", "recovery" or "readmission": names the step in the store, the injected
            faults' phase after the rebuild, and the log lines.
        world: how the world changes.
        iteration: the iteration the change happens at.
        old_layout: the running layout, in ranks of the world the moves run in.
        new_layout: the target, in the same ranks (GROW: the grown world's, joiners included).
        transfers: exactly the plan's (``Plan.transfers`` / ``SurvivorPlan.transfers``), in those ranks.
        new_rank: SHRINK: old rank -> rank in the re-formed world (ranks it lacks leave).
        move_world: SHRINK: the old ranks that meet in a world of their own to move state (every
            survivor of a fail-stop, and the standbys it takes back); None: state moves in the
            current world.
        failed: SHRINK: ranks the change is made without; one of them that is still running sends
            nothing and leaves first.
        watch_old_world: SHRINK: keep watching the old world's heartbeats until the new world
            commits (a recovery names whoever fails while it re-forms and plans again).
        reload_own: SHRINK: a rank that receives nothing from another keeps its own state whole
            (same stage, same shapes) instead of copying it unit by unit.
        identity: GROW: launch rank of every rank of the grown world. SHRINK: launch rank of every
            old rank and of each standby taken back (numbered after the old world's ranks).
        joining_rank: on a process that holds no state and joins: GROW, its rank in the grown
            world (working ranks keep theirs); SHRINK, a standby's rank in the plan (after the old
            world's).
        scheduler_state: GROW, and a SHRINK's joiner: the working ranks' LR schedule.
        adam_template, loss_scale: on a joiner: what shapes its Adam states and its loss scaler.
        leave: called on a rank the new world does not include, once it has sent what others need;
            it must raise (``StopTraining``, or ``StandingBy``; or ``ChangeFailed`` when that world
            did not form and the rank stays for the driver's next attempt, its state untouched).
        part_sources: under Megatron's distributed optimizer. SHRINK (``plan.part_sources``): dead
            rank -> the live rank keeping the copy of its part of the optimizer state (empty when
            nobody died: a re-plan leaving ranks out). Every survivor then sends the kept ranks the
            parts they lack before leaving, and the rebuilt optimizer is split anew from them
            (``optimizer_parts``). With ``transfers`` too (every replica re-formed at a smaller TP
            degree, whose positions are not the old ones), every survivor receives every part of its
            old position, the transfers move weights and whole optimizer states to the new TP
            shards, and the rebuilt optimizer takes its part of those. GROW (empty): every member
            receives its position's parts in the grown world, the joiners too, and the model's
            weights are gathered from them.
        filled: SHRINK: dead rank -> the standby taking its place (``plan.filled``); under the
            distributed optimizer a standby receives every part of that place's position.
    """

    kind: str
    world: World
    iteration: int
    old_layout: Layout
    new_layout: Layout
    transfers: tuple = ()
    new_rank: Mapping[int, int] | None = None
    move_world: tuple[int, ...] | None = None
    failed: frozenset[int] = frozenset()
    watch_old_world: bool = False
    reload_own: bool = False
    identity: tuple[int, ...] | None = None
    joining_rank: int | None = None
    scheduler_state: dict | None = None
    adam_template: dict | None = None
    loss_scale: list | None = None
    leave: Callable[[int], None] | None = None
    part_sources: Mapping[int, int] | None = None
    filled: Mapping[int, int] | None = None


class Executor(Protocol):
    """What the life cycle uses of the process running it (``resilience.ResilienceHooks``)."""

    args: object
    cfg: object
    store: object

    @property
    def backend(self) -> str: ...

    def inject(self, iteration: int, phase: str) -> None:
        """Apply an injected kill aimed at ``phase`` of an adaptation."""

    def failure_among(self, members) -> Callable[[], str | None]:
        """A reason to give up on a world of ``members``: the heartbeats name one failed."""

    def all_done(self, step: str, members: int, finished: bool) -> bool:
        """One answer for every member: did all of them finish ``step``."""

    def watch(self, run: RunState) -> None:
        """Watch the heartbeats of ``run``'s world (stopping any earlier watch)."""

    def unwatch(self) -> None:
        """Stop watching the current world's heartbeats."""

    def record_moved(self, iteration: int, rank: int, ran: list, num_bytes: int) -> None:
        """Say which transfers this rank ran (ranks of the world they ran in)."""

    def device(self):
        """This process's device (where a standby receives its state)."""

    def rebuild(self, layout: Layout, rank: int, sync: LayoutGradSync | None) -> TrainingObjects:
        """Model chunks, DDP, optimizer and LR schedule for ``rank``'s replica of the installed
        ``layout`` (the training loop decides how they are built; nothing is moved into them)."""

    def settle_saves(self, keep: bool) -> None:
        """Checkpoint saves of the old world still being written: finished in it (``keep``: every
        member is alive) or dropped (a member failed: none of them can be finished)."""


def apply(change: LayoutChange, run: RunState, env: Executor) -> RunState:
    """Carry out ``change`` from ``run``; returns the state the job goes on from.

    Raises:
        ChangeFailed: a member failed before the change committed (``error.run``: the state every
            member is back on).
        StopTraining: this process leaves (``change.leave``).
    """
    timeout_s = env.cfg.collective_timeout_s
    env.settle_saves(keep=change.kind != "recovery")
    ran: list = []
    received: dict = {}
    moved = 0
    messages = run.messages
    parts = None  # every part of this rank's position, when the optimizer's parts moved
    whole = None  # its old position's whole optimizer state, when the positions change with the parts
    if change.world is World.SHRINK:
        received, parts, whole = _move_out_and_reform(change, run, env, ran)
        rank, layout = change.new_rank[run.rank], change.new_layout.relabel(change.new_rank)
        identity = run.renumbered(change.new_rank) if change.identity is None else \
            tuple(change.identity[old] for old in sorted(change.new_rank, key=change.new_rank.get))
    elif change.world is World.GROW:
        _form_grown_world(change, run, env)
        rank, layout, identity = dist.get_rank(), change.new_layout, change.identity
    else:
        rank, layout, identity = run.rank, change.new_layout, run.identity
    # Where every member stands if the change is abandoned: the old layout, in the world they are in.
    back = run if change.world is World.SAME else run.replace(sync=None, messages=None)
    groups = new_objects = failure = sync = copies = None
    try:
        groups = build_groups(layout, rank, timeout=timeout_s, connect_timeout=env.cfg.rendezvous_timeout_s)
        install(groups)
        if change.world is not World.SAME:
            messages = message_group(timeout_s, env.cfg.rendezvous_timeout_s)  # one per world, made as it forms
            back = back.replace(messages=messages)
        sync = None if layout.replicas_alike() else LayoutGradSync(layout, rank, groups)
        new_objects = env.rebuild(layout, rank, sync)
        if change.world is not World.SHRINK:
            env.inject(change.iteration, change.kind)
        if change.world is World.SAME and is_distributed(run.objects.optimizer):
            moved, copies = _move_with_whole_states(change, run, rank, new_objects, ran)
        elif change.world is World.GROW and change.part_sources is not None:
            parts = _grown_parts(change, run, rank, env)
            _carry_into_grown(change, run, new_objects)
        elif whole is not None:
            parts = _parts_resharded(change, run, new_objects, received, parts, whole)
        else:
            moved += _move_state(change, run, rank, new_objects, received, ran)
        if parts is not None:
            copies = _split_parts_anew(run, layout, rank, new_objects, parts)
    except RuntimeError as error:
        failure = error
    if change.world is World.SHRINK:
        committed = failure is None  # no agreement: the old world is gone (see the module docstring)
    else:
        # A rank that failed never counts as finished, so it always goes back with the others.
        same = change.world is World.SAME
        step = f"{change.kind}{change.iteration}" if same else "grown"
        members = change.old_layout.world_size if same else dist.get_world_size()
        committed = env.all_done(step, members, finished=failure is None)
    if not committed:
        if change.world is World.SAME:
            install(run.groups)
            if groups is not None:
                teardown(groups)
        why = str(failure).splitlines()[0][:120] if failure is not None else "another rank failed"
        log_line(f" resihp: {_name(change, run)}: the {change.kind} at iteration {change.iteration} failed before "
                 f"every member had its state ({why}); back on the old layout")
        raise ChangeFailed(f"a member failed before every member had its state for the {change.kind} at "
                           f"iteration {change.iteration}: {why}", back) from failure
    if change.world is World.SAME:
        teardown(run.groups)
    if change.world is not World.SHRINK:  # a SHRINK's moves were recorded as they ran, before the re-form
        env.record_moved(change.iteration, rank, ran, moved)
    new = RunState(layout=layout, groups=groups, rank=rank, launch_rank=run.launch_rank, identity=tuple(identity),
                   generation=run.generation, objects=new_objects, quotas=run.quotas, messages=messages, sync=sync,
                   part_copies=copies)
    if change.world is World.SHRINK:
        env.watch(new)  # the old world's watch ends here (a recovery kept it while re-forming)
    return new


def _move_out_and_reform(change: LayoutChange, run: RunState, env: Executor,
                         ran: list) -> tuple[dict, StagedParts | None, dict | None]:
    """SHRINK: send what the kept ranks need while every holder is a member, let leavers go, and
    form the smaller world. Returns what this rank received (``reshard.stage_transfers``), when the
    optimizer's parts moved every part of its position (``optimizer_parts.stage_parts``), and when
    the positions change too (``LayoutChange.part_sources``) its old position's whole optimizer
    state, which its transfers were read from.

    Raises:
        OptimizerPartsStale: the survivors' parts do not make one optimizer state.
    """
    old_rank, new_rank = run.rank, change.new_rank
    # A standby taken back watches no world's heartbeats: it waits out a world that does not form.
    joining = change.joining_rank is not None
    # A standby holds no part, but receives every part of its place's position.
    sends_parts = change.part_sources is not None and (run.part_copies is not None or joining)
    # Parts of positions the new layout does not have: every survivor, which may send a transfer,
    # first takes its old position's whole state from them.
    reshards = sends_parts and bool(change.transfers)
    if old_rank not in new_rank and (not (change.transfers or sends_parts) or old_rank in change.failed):
        change.leave(old_rank)
    if change.kind == "recovery":
        env.inject(change.iteration, "reform")
    parts = whole = None
    try:
        # In the world the moves run in: the survivors' one, or the old world when nobody failed
        # (a re-plan leaving ranks out, which hand their parts over before they go).
        peer_rank = (lambda r: r) if change.move_world is None else list(change.move_world).index
        received = {}
        if change.move_world is None or change.transfers or sends_parts:
            if change.move_world is not None:
                # Spares stay for this step: they may hold what a moved stage group needs.
                recovery.join_moves_world(env.store, run.generation, old_rank, list(change.move_world), env.backend,
                                          env.cfg.collective_timeout_s,
                                          stop=(lambda: None) if joining else env.failure_among(change.move_world),
                                          joined=lambda: env.inject(change.iteration, "moves"),
                                          connect_s=env.cfg.rendezvous_timeout_s)
            if reshards:  # a recovery's: every survivor is in the move world, and any may send
                parts = stage_parts(run.part_copies, change.old_layout, old_rank, change.part_sources,
                                    {r: r for r in change.move_world}, peer_rank=peer_rank, device=env.device())
                whole = whole_states(run.objects.optimizer, parts.parts)
            received = stage_transfers(change.transfers, change.old_layout, old_rank, run.objects,
                                       peer_rank=peer_rank, ran=ran, whole=whole)
            if sends_parts and not reshards:
                parts = stage_parts(run.part_copies, change.old_layout, old_rank, change.part_sources, new_rank,
                                    peer_rank=peer_rank, places=change.filled, device=env.device())
        env.record_moved(change.iteration, old_rank, ran, sum(f.numel() * f.element_size() for f in received.values()))
        if not change.watch_old_world:
            env.unwatch()
        if old_rank not in new_rank:
            change.leave(old_rank)
        recovery.meet_and_reform(env.store, str(run.generation), new_rank[old_rank], len(new_rank), env.backend,
                                 env.cfg.collective_timeout_s,
                                 stop=(lambda: None) if joining else env.failure_among(new_rank),
                                 met=lambda: env.inject(change.iteration, "rendezvous"),
                                 connect_s=env.cfg.rendezvous_timeout_s)
    except (RuntimeError, TimeoutError) as error:
        raise ChangeFailed(f"world {run.generation} did not form: {error}", run) from error
    return received, parts, whole


def _parts_resharded(change: LayoutChange, run: RunState, new_objects, received: dict, staged: StagedParts,
                     whole: dict) -> StagedParts:
    """SHRINK under Megatron's distributed optimizer to positions the old layout does not have
    (every replica at a smaller TP degree): the rebuilt model's weights and whole optimizer states
    are filled from the staged transfers (read from the old positions' whole states); returned as
    one part covering every parameter, of the update the parts agreed on, for ``_split_parts_anew``."""
    old = run.objects
    new_objects.optimizer.load_state_dict(old.optimizer.state_dict())  # step counts, param groups
    new_whole = whole_states(new_objects.optimizer)
    unstage_transfers(change.transfers, change.old_layout, change.new_layout, run.rank, old, new_objects, received,
                      whole=(whole, new_whole))
    carry_schedule(old, new_objects)
    return staged._replace(parts=[whole_part(new_objects.optimizer, new_whole, staged.update)])


def _grown_parts(change: LayoutChange, run: RunState, rank: int, env: Executor) -> StagedParts:
    """GROW under Megatron's distributed optimizer, in the grown world: every member receives every
    part of its position (a joiner, of the position it joins, seated at the old layout's rank there),
    from which its rebuilt optimizer takes its part and its model its weights (``_split_parts_anew``)."""
    old = change.old_layout
    seats = {}
    for joiner in range(old.world_size, change.new_layout.world_size):
        stage, tp_rank = change.new_layout.stage_of(joiner)[1], change.new_layout.tp_rank_of(joiner)
        seats[joiner] = old.replicas[0].stages[stage].ranks[tp_rank]
    return stage_parts(run.part_copies, old, rank, change.part_sources, {r: r for r in range(dist.get_world_size())},
                       peer_rank=lambda r: r, device=env.device(), seats=seats)


def _carry_into_grown(change: LayoutChange, run: RunState, new_objects) -> None:
    # What the optimizer keeps besides its parts, as ``_move_state`` carries it into a grown world (a
    # joiner takes the step counts and parameter groups from a working rank's, in ``stage_parts``).
    if run.objects is not None:
        new_objects.optimizer.load_state_dict(run.objects.optimizer.state_dict())
    _take_working_schedule(change, run.objects, new_objects)


def _take_working_schedule(change: LayoutChange, old, new_objects) -> None:
    """Into a world with members that were standing by: every member takes the working ranks' LR
    schedule (``change.scheduler_state``) and loss scale (a working rank its own optimizer's, a
    joiner the one the change carries)."""
    new_objects.scheduler.load_state_dict(change.scheduler_state)
    load_loss_scale_state(new_objects.optimizer,
                          loss_scale_state(old.optimizer) if old is not None else change.loss_scale or [])


def _split_parts_anew(run: RunState, layout: Layout, rank: int, new_objects, staged: StagedParts) -> PartCopies:
    """The rebuilt distributed optimizer's part from every part of this rank's position, the model's
    parameters gathered from it, and the new world's copies made (every member at once). A standby
    taken back first takes the position's step counts and parameter groups (``staged``)."""
    if staged.optimizer_state is not None:
        new_objects.optimizer.load_state_dict(staged.optimizer_state)
    write_parts(new_objects.optimizer, staged.parts)
    set_back_adam_steps(new_objects.optimizer, staged.steps_back)  # an update undone (``agree_on_update``)
    regather(new_objects.optimizer)
    return _send_copies(layout, rank, new_objects.optimizer, staged.update)


def _send_copies(layout: Layout, rank: int, optimizer, updates: int) -> PartCopies:
    """The new world's copies of the optimizer's parts, sent before the change commits (every member
    at once), so that a failure right after it finds them."""
    copies = PartCopies(layout, rank, optimizer, updates=updates)
    copies.send()
    return copies


def _move_with_whole_states(change: LayoutChange, run: RunState, rank: int, new_objects,
                            ran: list) -> tuple[int, PartCopies | None]:
    """SAME world under Megatron's distributed optimizer: a part is addressed by the layers of its
    stage, which move, so every rank takes its position's whole optimizer state from the parts
    (one exchange over the position), the plan's transfers move weights and whole states, and the
    rebuilt optimizer takes its new part from them. Returns bytes moved and the new world's copies
    (sent before the change commits, every member at once).

    The whole state of a stage is held once per rank of it while the change runs."""
    old = run.objects
    updates = run.part_copies.updates if run.part_copies is not None else 0
    whole = (whole_states(old.optimizer, position_parts(old.optimizer, change.old_layout, run.rank, updates)),
             whole_states(new_objects.optimizer))
    new_objects.optimizer.load_state_dict(old.optimizer.state_dict())  # step counts, param groups
    moved = apply_transfers(change.transfers, change.old_layout, change.new_layout, rank, old, new_objects, ran=ran,
                            whole=whole)
    write_parts(new_objects.optimizer, [whole_part(new_objects.optimizer, whole[1], updates)])
    carry_schedule(old, new_objects)
    if run.part_copies is None:
        return moved, None
    return moved, _send_copies(change.new_layout, rank, new_objects.optimizer, updates)


def _form_grown_world(change: LayoutChange, run: RunState, env: Executor) -> None:
    """GROW: form the grown world (the old one is left only once every member has arrived), and
    watch its heartbeats from the start: a member that fails while it is set up must be named."""
    new_rank = run.rank if change.joining_rank is None else change.joining_rank
    try:
        recovery.meet_and_reform(env.store, str(run.generation), new_rank, len(change.identity), env.backend,
                                 env.cfg.collective_timeout_s, stop=env.failure_among(change.old_layout.world_ranks)
                                 if change.joining_rank is None else lambda: None,
                                 met=lambda: env.inject(change.iteration, "rendezvous"),
                                 connect_s=env.cfg.rendezvous_timeout_s)
    except (RuntimeError, TimeoutError) as error:
        if change.joining_rank is None and not dist.is_initialized():
            # The rendezvous itself failed (a member died after saying it was there): the old
            # world is gone and the grown one never formed. The old world's heartbeats still
            # run, so the recovery re-forms the working ranks, without whoever failed.
            log_line(f" resihp: {_name(change, run)}: world {run.generation} did not form "
                     f"({str(error).splitlines()[0][:120]}); re-forming the working ranks")
        raise ChangeFailed(f"world {run.generation} did not form: {error}", run) from error
    env.watch(run.replace(identity=tuple(change.identity), rank=new_rank))


def _name(change: LayoutChange, run: RunState) -> str:
    """This process in a log line: a standby joining a grown world has no rank in the old one."""
    if change.world is World.GROW and change.joining_rank is not None:
        return f"launch rank {run.launch_rank}"
    return rank_name(run.rank, run.identity)


def _move_state(change: LayoutChange, run: RunState, rank: int, new_objects, received: dict, ran: list) -> int:
    """Fill the rebuilt objects: exactly ``change.transfers``, then what every optimizer keeps
    besides its tensors (step counts, LR schedule, loss scale). Returns bytes this rank moved."""
    old = run.objects
    if change.world is World.SHRINK:
        if change.reload_own and old is not None and \
                not any(t.dst == run.rank and t.src != run.rank for t in change.transfers):
            # A rank at the stage it held before: its own state, same shapes, is all it needs.
            for new_chunk, old_chunk in zip(new_objects.chunks, old.chunks, strict=True):
                new_chunk.load_state_dict(old_chunk.state_dict())
            new_objects.optimizer.load_state_dict(old.optimizer.state_dict())
        else:
            unstage_transfers(change.transfers, change.old_layout, change.new_layout, run.rank, old, new_objects,
                              received, adam_template=change.adam_template)
        if old is not None:
            carry_schedule(old, new_objects)
        else:  # a standby taken back
            _take_working_schedule(change, None, new_objects)
        return 0
    moved = apply_transfers(change.transfers, change.old_layout, change.new_layout, rank, old, new_objects,
                            adam_template=change.adam_template, ran=ran)
    if change.world is World.SAME:
        carry_schedule(old, new_objects)
    else:
        _take_working_schedule(change, old, new_objects)
    return moved
