"""Re-formable process groups: build this rank's groups from a Layout and install them for megatron-core.

Responsible for three steps of a reconfiguration, each a function:

- ``build_groups(layout, rank, timeout)``: every rank of the current world creates every group
  the Layout implies, in one global order, and keeps a ``ParallelGroups`` record of its own.
- ``install(groups)`` / ``uninstall()``: write that record into the module globals of
  ``megatron.core.parallel_state`` (the only place in the project that does), and reset them.
- ``teardown(groups)``: uninstall if installed, then ``destroy_process_group`` every group the
  record created, so repeated re-forms leak no groups, threads or file descriptors.
- ``message_group(timeout)``: the world's gloo group for detection's messages (one per world).
- ``reform_world(...)`` / ``dense_ranks(...)``: after a rank died, destroy the old default group
  and join a smaller world through a fresh store prefix, survivors taking dense new ranks.

What megatron-core reads (0.16.x and 0.19.x). GPTModel, its attention and linear layers, DDP, the optimizer
factory, the 1F1B schedule, p2p communication and ``finalize_model_grads`` either take a
``ProcessGroupCollection`` built by ``ProcessGroupCollection.use_mpu_process_groups()`` or call the
``parallel_state.get_*`` getters directly. Both read these globals, which ``install`` sets:

- groups: ``_TENSOR_MODEL_PARALLEL_GROUP``, ``_PIPELINE_MODEL_PARALLEL_GROUP``,
  ``_MODEL_PARALLEL_GROUP``, ``_EMBEDDING_GROUP``, ``_POSITION_EMBEDDING_GROUP``,
  ``_DATA_PARALLEL_GROUP``, ``_DATA_PARALLEL_GROUP_GLOO``, ``_DATA_PARALLEL_GROUP_WITH_CP``,
  ``_DATA_PARALLEL_GROUP_WITH_CP_GLOO``, ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO)``,
  ``_CONTEXT_PARALLEL_GROUP``, ``_TENSOR_AND_CONTEXT_PARALLEL_GROUP``,
  ``_TENSOR_AND_DATA_PARALLEL_GROUP(_WITH_CP)``, the expert groups (``_EXPERT_MODEL_PARALLEL_GROUP``,
  ``_EXPERT_TENSOR_PARALLEL_GROUP``, ``_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP``,
  ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``, ``_EXPERT_DATA_PARALLEL_GROUP(_GLOO)``,
  ``_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP(_GLOO)``: the optimizer factory asks for them even
  without MoE) and ``_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP``;
- global rank lists: ``_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS``, ``_PIPELINE_GLOBAL_RANKS`` (first /
  last / next / previous pipeline rank), ``_MODEL_PARALLEL_GLOBAL_RANKS``,
  ``_DATA_PARALLEL_GLOBAL_RANKS(_WITH_CP)``, ``_CONTEXT_PARALLEL_GLOBAL_RANKS``,
  ``_EMBEDDING_GLOBAL_RANKS`` and ``_POSITION_EMBEDDING_GLOBAL_RANKS`` (``is_rank_in_embedding_group``),
  ``_EXPERT_MODEL_PARALLEL_RANKS``;
- overrides, reset to None so the getters derive sizes and ranks from the groups:
  ``_MPU_{TENSOR,PIPELINE}_MODEL_PARALLEL_{WORLD_SIZE,RANK}``, ``_MPU_DATA_PARALLEL_*``,
  ``_MPU_EXPERT_*``;
- 0.16 only: ``_DATA_PARALLEL_GROUP_WITH_CP_AG`` (None); 0.19 only: the generalized-TP weight
  rematerialisation groups (size 1: this rank alone) and the ``*_WITH_GTP_REMAT`` / ``*_WITH_EGTP``
  data-parallel groups, which alias the plain ones and are what the default DP getters read;
- ``_GLOBAL_MEMORY_BUFFER`` is created if missing.

The interleaved schedule's virtual stages (``_VIRTUAL_PIPELINE_MODEL_PARALLEL_*``) are the job's,
not a world's: set once as Megatron's initialization sets them, they outlive every re-form.

Context parallelism and expert parallelism are 1: their groups are this rank alone or alias the
TP / DP groups, exactly as ``initialize_model_parallel(tp, pp)`` lays them out. For a uniform
Layout the memberships equal megatron-core's (tested). Replicas that differ only in their layer
split keep megatron-core's DP groups by position (stage index, TP rank): Megatron-LM's loop counts
replicas, splits the data and averages the logged loss over them, and DDP, whose own sync those
groups would carry, is not asked to sync. For other heterogeneous Layouts the DP group is the set
of ranks holding the same (stage index, layer range, TP degree, TP rank) position. The
layer-wise gradient sync sets of ``resihp_ext.shard_map.sync_rank_sets`` are built as well, in
``sync_groups``, for ``layer_sync.LayoutGradSync`` (only when replicas differ: alike ones sync
through megatron-core's DDP).

How it is undone: ``uninstall()`` restores every global it wrote to the value it had before the
first ``install`` (None after a fresh start); ``teardown(groups)`` also destroys the groups.
Modules capture groups at construction, so a model, DDP wrapper and optimizer built on one record
must be rebuilt after the next; nothing here moves weights.

This module must never decide a layout, and is the only one that creates groups (``build_groups``,
``message_group``); their users are handed them
(every rank has to create the same groups in the same order, or a later group hangs).
Layout ranks are ranks of the *current* default group: after ``reform_world`` the Layout has to be
expressed in the dense new ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Iterable

import torch.distributed as dist
from megatron.core import package_info
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from resihp_ext.layout import Layout
from resihp_ext.shard_map import sync_rank_sets

SUPPORTED_MCORE = ("0.16", "0.19")
MCORE_SERIES = ".".join(package_info.__version__.split(".")[:2])
if MCORE_SERIES not in SUPPORTED_MCORE:
    raise ImportError(
        f"megatron.resihp.parallel_state_patch writes the globals of megatron-core {' and '.join(SUPPORTED_MCORE)}, "
        f"but megatron-core {package_info.__version__} is installed; install megatron-core==0.19.2 "
        "or re-check the globals listed in this module's docstring against the new parallel_state.py"
    )

Group = dist.ProcessGroup
Timeout = datetime.timedelta | float


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """One rank's process groups for one Layout, plus the facts megatron-core derives from them.

    Groups are None on a rank the Layout does not use (a spare); ``member`` says which.
    ``owned`` lists every group object this rank created (and must destroy), each once.
    """

    layout: Layout
    rank: int
    member: bool
    tp_group: Group | None = None
    pp_group: Group | None = None
    dp_group: Group | None = None
    dp_group_gloo: Group | None = None
    mp_group: Group | None = None
    cp_group: Group | None = None
    tp_dp_group: Group | None = None
    embedding_group: Group | None = None
    position_embedding_group: Group | None = None
    layout_group: Group | None = None
    sync_groups: dict[tuple[int, ...], Group] = dataclasses.field(default_factory=dict)
    tp_ranks: tuple[int, ...] = ()
    pp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    mp_ranks: tuple[int, ...] = ()
    embedding_ranks: tuple[int, ...] = ()
    position_embedding_ranks: tuple[int, ...] = ()
    owned: tuple[Group, ...] = ()

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.pp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The TP group of this rank's stage, in TP-rank order (same as ``tp_ranks``)."""
        return self.tp_ranks


def _timedelta(timeout: Timeout) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))


def _connected(make, gloo: bool, timeout: Timeout, connect_timeout: Timeout | None):
    """``make(timeout)`` a group, bounding a gloo group's connecting by ``connect_timeout``.

    A gloo group connects every pair of its members as it is made, in C code that holds the GIL,
    so a member that dies then is noticed only when the connect times out: given the collective
    timeout, that is the whole of it. Made with the shorter bound, the group then takes the
    collective timeout for its collectives. Other backends connect lazily, at their first
    collective, and are made with the collective timeout."""
    full = _timedelta(timeout)
    connect = full if connect_timeout is None or not gloo else min(full, _timedelta(connect_timeout))
    group = make(connect)
    if connect < full and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        group.set_timeout(full)
    return group


def _group_specs(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    """Every group the Layout implies, as (kind, ranks), in the one order all ranks follow.

    Kinds may repeat (one entry per group of that kind); ranks keep megatron-core's order
    (pipeline order for pp/embedding groups, TP-rank order for tp groups, ascending otherwise).
    """
    specs: list[tuple[str, tuple[int, ...]]] = []
    dp_classes: dict[tuple, list[int]] = {}
    tp_dp_classes: dict[tuple, list[int]] = {}
    by_position = layout.replicas_line_up()
    for r, replica in enumerate(layout.replicas):
        degrees = {stage.tp_degree for stage in replica.stages}
        if len(degrees) != 1:
            raise ValueError(
                f"replica {r} mixes TP degrees {sorted(degrees)} across its stages; megatron-core's "
                "pipeline p2p needs one TP degree per replica, so give every stage of a replica the same TP degree"
            )
        for s, stage in enumerate(replica.stages):
            position = (s,) if by_position else (s, stage.first_layer, stage.num_layers, stage.tp_degree)
            tp_dp_classes.setdefault(position, []).extend(stage.ranks)
            for t, rank in enumerate(stage.ranks):
                dp_classes.setdefault((*position, t), []).append(rank)
    # Same order as initialize_model_parallel: dp, cp, mp, tp, pp + embeddings, tp-dp.
    specs += [("dp", tuple(sorted(ranks))) for ranks in dp_classes.values()]
    specs += [("cp", (rank,)) for rank in layout.world_ranks]
    specs += [("mp", tuple(sorted(rep.ranks))) for rep in layout.replicas]
    specs += [("tp", stage.ranks) for rep in layout.replicas for stage in rep.stages]
    for rep in layout.replicas:
        for t in range(rep.stages[0].tp_degree):
            pp = tuple(stage.ranks[t] for stage in rep.stages)
            specs.append(("pp", pp))
            specs.append(("embd", tuple(ps.default_embedding_ranks(list(pp)))))
            specs.append(("pos_embd", tuple(ps.default_position_embedding_ranks(list(pp)))))
    specs += [("tp_dp", tuple(sorted(ranks))) for ranks in tp_dp_classes.values()]
    specs.append(("layout", layout.world_ranks))
    if not layout.replicas_alike():  # alike replicas sync through megatron-core's DDP on the dp groups
        specs += [("sync", ranks) for ranks in sync_rank_sets(layout)]
    return specs


def build_groups(layout: Layout, rank: int | None = None, timeout: Timeout = 1800.0,
                 connect_timeout: Timeout | None = None) -> ParallelGroups:
    """Create every group ``layout`` implies; collective over the whole current world.

    Every rank of the default group must call this with the same Layout (spares included), since
    ``new_group`` names groups by a per-process counter. ``use_local_synchronization=True`` is not
    used: it names a group by its ranks plus the number of groups the process already has, which
    differs between ranks of a heterogeneous Layout and after a teardown, so members would meet
    under different store prefixes.

    Args:
        layout: the placement, in ranks of the current default group.
        rank: this rank (default ``dist.get_rank()``).
        timeout: collective timeout of every group, seconds or timedelta. Bounds how long a
            survivor blocks on a dead peer (megatron-core's default is 30 minutes).
        connect_timeout: bound on connecting each gloo group as it is made (``_connected``);
            None: the collective timeout.

    Returns:
        This rank's ``ParallelGroups`` (``member=False`` on a rank the Layout does not use).
    """
    rank = dist.get_rank() if rank is None else rank
    if max(layout.world_ranks) >= dist.get_world_size():
        raise ValueError(
            f"layout uses rank {max(layout.world_ranks)} but the world has {dist.get_world_size()} ranks; "
            "express the layout in ranks of the current world (see dense_ranks after reform_world)"
        )
    td = _timedelta(timeout)
    # A second gloo group with the same members only duplicates connections when DP already runs on gloo.
    separate_gloo = dist.get_backend() != "gloo"
    on_gloo = not separate_gloo
    mine: dict[str, tuple[tuple[int, ...], Group]] = {}
    sync: dict[tuple[int, ...], Group] = {}
    owned: list[Group] = []
    for kind, ranks in _group_specs(layout):
        group = _connected(lambda t: dist.new_group(list(ranks), timeout=t, group_desc=f"RESIHP_{kind.upper()}"),
                           on_gloo, td, connect_timeout)
        if rank not in ranks:
            continue
        owned.append(group)
        if kind == "sync":
            sync[ranks] = group
        else:
            assert kind not in mine, f"rank {rank} is in two {kind} groups"
            mine[kind] = (ranks, group)
    if separate_gloo:
        # After all others, in the same order on every rank.
        for kind, ranks in _group_specs(layout):
            if kind != "dp":
                continue
            group = _connected(lambda t: dist.new_group(list(ranks), timeout=t, backend="gloo",
                                                        group_desc="RESIHP_DP_GLOO"), True, td, connect_timeout)
            if rank in ranks:
                owned.append(group)
                mine["dp_gloo"] = (ranks, group)
    if not layout.contains(rank):
        return ParallelGroups(layout=layout, rank=rank, member=False, sync_groups=sync, owned=tuple(owned))
    embd = mine.get("embd", ((), None))
    pos = mine.get("pos_embd", ((), None))
    return ParallelGroups(
        layout=layout,
        rank=rank,
        member=True,
        tp_group=mine["tp"][1],
        pp_group=mine["pp"][1],
        dp_group=mine["dp"][1],
        dp_group_gloo=mine.get("dp_gloo", mine["dp"])[1],
        mp_group=mine["mp"][1],
        cp_group=mine["cp"][1],
        tp_dp_group=mine["tp_dp"][1],
        embedding_group=embd[1],
        position_embedding_group=pos[1],
        layout_group=mine["layout"][1],
        sync_groups=sync,
        tp_ranks=mine["tp"][0],
        pp_ranks=mine["pp"][0],
        dp_ranks=mine["dp"][0],
        mp_ranks=mine["mp"][0],
        embedding_ranks=embd[0],
        position_embedding_ranks=pos[0],
        owned=tuple(owned),
    )


# Every parallel_state global install() writes; uninstall() restores exactly these.
_GLOBALS = (
    "_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
    "_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GROUP", "_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_CONTEXT_PARALLEL_GROUP", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "_TENSOR_AND_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_TENSOR_PARALLEL_GROUP", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "_CONTEXT_PARALLEL_GLOBAL_RANKS",
    "_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS", "_EXPERT_MODEL_PARALLEL_RANKS",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK", "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
    "_GLOBAL_MEMORY_BUFFER",
) + {
    "0.16": ("_DATA_PARALLEL_GROUP_WITH_CP_AG",),
    # Generalized-TP weight rematerialisation: with its size 1 its groups are this rank alone and
    # its "with GTP remat" data-parallel groups alias the plain ones, which the default DP getters read.
    "0.19": ("_GTP_WEIGHT_REMAT_GROUP", "_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
             "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
             "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
             "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
             "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP"),
}[MCORE_SERIES]
for _name in _GLOBALS:
    assert hasattr(ps, _name), f"megatron.core.parallel_state has no {_name}; update parallel_state_patch"

_saved: dict[str, object] | None = None
_installed: ParallelGroups | None = None


def _values(g: ParallelGroups) -> dict[str, object]:
    if not g.member:
        return {name: None for name in _GLOBALS}
    dp, dp_gloo, tp, mp = g.dp_group, g.dp_group_gloo, g.tp_group, g.mp_group
    by_series = {
        "0.16": {"_DATA_PARALLEL_GROUP_WITH_CP_AG": None},
        "0.19": {
            "_GTP_WEIGHT_REMAT_GROUP": g.cp_group,
            "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": [g.rank],
            "_EXPERT_GTP_WEIGHT_REMAT_GROUP": g.cp_group,
            "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": [g.rank],
            "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": dp,
            "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": dp,
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": dp,
            "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": dp,
            "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": dp,
            "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": mp,
        },
    }
    return {
        **by_series[MCORE_SERIES],
        "_TENSOR_MODEL_PARALLEL_GROUP": tp,
        "_PIPELINE_MODEL_PARALLEL_GROUP": g.pp_group,
        "_MODEL_PARALLEL_GROUP": mp,
        "_EMBEDDING_GROUP": g.embedding_group,
        "_POSITION_EMBEDDING_GROUP": g.position_embedding_group,
        "_DATA_PARALLEL_GROUP": dp,
        "_DATA_PARALLEL_GROUP_GLOO": dp_gloo,
        # CP = 1: "with CP" groups are the DP groups themselves.
        "_DATA_PARALLEL_GROUP_WITH_CP": dp,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": dp_gloo,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": dp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": dp_gloo,
        "_CONTEXT_PARALLEL_GROUP": g.cp_group,
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": tp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": g.tp_dp_group,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": g.tp_dp_group,
        # EP = 1 and expert TP = TP: expert groups coincide with the dense ones.
        "_EXPERT_MODEL_PARALLEL_GROUP": g.cp_group,
        "_EXPERT_TENSOR_PARALLEL_GROUP": tp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": tp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": mp,
        "_EXPERT_DATA_PARALLEL_GROUP": dp,
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": dp_gloo,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": dp_gloo,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,
        # One distributed-optimizer instance spanning every rank of the layout.
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": g.layout_group,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": list(g.tp_ranks),
        "_PIPELINE_GLOBAL_RANKS": list(g.pp_ranks),
        "_MODEL_PARALLEL_GLOBAL_RANKS": list(g.mp_ranks),
        "_DATA_PARALLEL_GLOBAL_RANKS": list(g.dp_ranks),
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": list(g.dp_ranks),
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": [g.rank],
        "_EMBEDDING_GLOBAL_RANKS": list(g.embedding_ranks) or None,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": list(g.position_embedding_ranks) or None,
        "_EXPERT_MODEL_PARALLEL_RANKS": [g.rank],
        # Overrides stay None: the getters then read sizes and ranks off the groups above.
        **{name: None for name in _GLOBALS if name.startswith(("_MPU_", "_VIRTUAL_"))},
        "_GLOBAL_MEMORY_BUFFER": ps._GLOBAL_MEMORY_BUFFER,
    }


def install(groups: ParallelGroups) -> ProcessGroupCollection | None:
    """Make megatron-core's ``parallel_state`` getters return ``groups``.

    Args:
        groups: the record from ``build_groups`` on this rank.

    Returns:
        A ``ProcessGroupCollection`` of the installed groups, for code that takes ``pg_collection=``;
        None on a spare rank (its globals are reset, so megatron-core reports "not initialized").
    """
    global _saved, _installed
    if _saved is None:
        _saved = {name: getattr(ps, name) for name in _GLOBALS}
    for name, value in _values(groups).items():
        setattr(ps, name, value)
    _installed = groups
    if not groups.member:
        return None
    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    return ProcessGroupCollection.use_mpu_process_groups()


def installed() -> ParallelGroups | None:
    """The record currently installed, or None."""
    return _installed


def uninstall() -> None:
    """Restore every global ``install`` wrote to its value before the first ``install``."""
    global _saved, _installed
    if _saved is not None:
        for name, value in _saved.items():
            setattr(ps, name, value)
    _saved, _installed = None, None


def _destroy(groups: Iterable[Group]) -> None:
    pg_map = dist.distributed_c10d._world.pg_map
    seen: set[int] = set()
    for group in groups:
        # Guarded: megatron-core's destroy_model_parallel may already have destroyed gloo DP groups.
        if id(group) in seen or group is None or group == dist.GroupMember.NON_GROUP_MEMBER or group not in pg_map:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


def teardown(groups: ParallelGroups) -> None:
    """Uninstall ``groups`` if installed, then destroy every group the record created.

    Local to this rank (no collective), so it is safe on survivors whose peers are dead.
    """
    if _installed is groups:
        uninstall()
    _destroy(groups.owned)


def message_group(timeout: Timeout, connect_timeout: Timeout | None = None):
    """The gloo group of the whole world that detection's messages travel on: None when the world
    group is gloo itself, else a new gloo group of every rank. One per world (it outlives the
    layouts of that world: posted receives wait on it across a re-plan), made when the world forms,
    collective like ``build_groups``; ``reform_world`` destroys it with the world."""
    if dist.get_backend() == "gloo":
        return None
    return _connected(lambda t: dist.new_group(backend="gloo", timeout=t, group_desc="RESIHP_MESSAGES"),
                      True, timeout, connect_timeout)


def dense_ranks(old_ranks_alive: Iterable[int]) -> dict[int, int]:
    """Survivors' new ranks: old ranks in ascending order get 0, 1, 2, ...

    Args:
        old_ranks_alive: ranks of the old world that survive (any order, no duplicates).

    Returns:
        ``{old rank: new rank}``; every survivor computes the same mapping from the same set.
    """
    alive = sorted(set(old_ranks_alive))
    return {old: new for new, old in enumerate(alive)}


def reform_world(
    store: dist.Store,
    new_rank: int,
    new_world_size: int,
    generation: int,
    backend: str = "gloo",
    timeout: Timeout = 1800.0,
    connect_timeout: Timeout | None = None,
) -> None:
    """Replace the default group by a ``new_world_size``-rank one; every survivor calls it.

    Uninstalls the parallel_state patch, destroys the old default group and every subgroup still
    registered (a dead peer makes them unusable anyway), and joins the new world through
    ``PrefixStore(f"resihp/gen{generation}/", store)`` so keys of earlier worlds cannot be read by
    mistake. Nothing else talks to the dead rank, so this does not block on it.

    Args:
        store: a store every survivor reaches and no dead rank hosts (e.g. the launcher's TCPStore).
        new_rank: this survivor's rank in the new world (see ``dense_ranks``).
        new_world_size: number of survivors.
        generation: a number every survivor agrees on and no earlier world used.
        backend: process group backend of the new world.
        timeout: default collective timeout of the new world.
        connect_timeout: bound on the gloo rendezvous of the new world (``_connected``): a member
            that dies in it costs this, not ``timeout``. None: ``timeout``.
    """
    uninstall()
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        # A world whose rendezvous failed took a group name and was never destroyed (which resets
        # the count): its members would name this world's groups one further than a process with
        # another history (a standby taken back), and the rendezvous keys would not meet.
        dist.distributed_c10d._world.group_count = 0

    def join(bound: datetime.timedelta):
        dist.init_process_group(backend, store=dist.PrefixStore(f"resihp/gen{generation}/", store),
                                rank=new_rank, world_size=new_world_size, timeout=bound)
        return dist.distributed_c10d._get_default_group()

    _connected(join, backend == "gloo", timeout, connect_timeout)


__all__ = [
    "ParallelGroups", "build_groups", "message_group", "install", "installed", "uninstall", "teardown",
    "dense_ranks", "reform_world", "SUPPORTED_MCORE",
]
