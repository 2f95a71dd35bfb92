"""This rank's part of Megatron's distributed optimizer state, its copy on the next rank, and the
parts a re-formed world's ranks receive.

Megatron's ``DistributedOptimizer`` gives each data-parallel rank of a (stage, TP shard) position
one contiguous range of the position's gradient buffer, and with it the fp32 main parameters and
Adam moments of that range. Here a part is described in model space, independent of the buffer's
padding (which changes with the data-parallel size): pieces ``(model chunk, parameter index,
start, end)`` over each parameter's flattened elements, and the values of ``KEYS`` over each piece.
Read and written through the optimizer's own accessors
(``_get_main_param_and_optimizer_states`` / ``_set_main_param_and_optimizer_states``).

- ``PartCopies``: after every optimizer update, each rank sends its part to the rank that keeps its
  copy and receives the part it keeps (``resihp_ext.optimizer_parts``: the next rank of the same
  position, a ring), one pair of point-to-point messages per rank, then waits for every rank's (a
  world-wide all-reduce of one element). The update count travels with each copy, so a recovery
  can tell a copy that missed the last update. While its step runs, each rank also keeps its own
  part as it was before the update, and it keeps the copy it held before the latest one: a failure
  between two ranks' updates, or between an update and its copy, then leaves every part one update
  back within reach, and the survivors go back to it and run the iteration again.
- ``stage_parts``: in the world of every survivor a recovery forms, the kept ranks receive the
  parts of their position they do not hold, each from its owner or, for a dead owner, from the
  rank keeping its copy (a spare taken back into a dead rank's place receives every part of that
  position); ``write_parts`` then fills the optimizer rebuilt for the new data-parallel size, and
  ``regather`` makes the model's parameters its main parameters.

What is chosen (whose copy each dead part comes from, whether the parts agree) is
``resihp_ext.optimizer_parts``'s; this module moves tensors.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from resihp_ext.layout import Layout
from resihp_ext.optimizer_parts import HeldCopy, agree_on_update, copied_owner, copy_holder, part_ring

# Adam's state besides its step count (restored from the optimizer's param groups, the same on
# every rank), in the order each piece's values are laid out.
KEYS = ("param", "exp_avg", "exp_avg_sq")


class OptimizerPartsStale(Exception):
    """The surviving parts do not make one optimizer state (a failure struck while the optimizer
    updated or while copies were sent): no in-place recovery. Not a ``RuntimeError``: the life
    cycle must not take it for a member that failed part-way."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One rank's part of a position's optimizer state.

    Attributes:
        pieces: int64 ``[n, 4]``: (model chunk, parameter index in the chunk, start, end) over the
            parameter's flattened elements.
        values: float32: for each piece in turn, each of ``KEYS`` over ``[start, end)``.
        updates: how many optimizer updates this state has taken since launch.
    """

    pieces: torch.Tensor
    values: torch.Tensor
    updates: int


def distributed_optimizers(optimizer) -> list:
    """The distributed optimizers behind Megatron's optimizer (a ``ChainedOptimizer`` holds one per
    parameter group kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ranges(optimizer):
    """(distributed optimizer, model parameter, its range in this rank's part), in bucket order."""
    for sub in distributed_optimizers(optimizer):
        for gbuf_range_maps in getattr(sub, "gbuf_ranges", []):
            for maps in gbuf_range_maps.values():
                for gbuf_range_map in maps:
                    for model_param, param_range_map in gbuf_range_map["param_map"].items():
                        yield sub, model_param, param_range_map["param"]


def device_of(optimizer) -> torch.device:
    """Where the optimizer's state lives, and so where its parts travel from (NCCL sends device
    tensors only; gloo host ones)."""
    return next(p for chunk in optimizer.model_chunks for p in chunk.parameters()).device


def part_bytes(optimizer) -> int:
    """The bytes of this rank's part (what one copy sends), without reading it."""
    return len(KEYS) * 4 * sum(span.size for _, _, span in _ranges(optimizer))


def _param_index(optimizer) -> dict:
    # The same module structure on every rank of a position, before and after a rebuild.
    return {p: (c, i) for c, chunk in enumerate(optimizer.model_chunks) for i, p in enumerate(chunk.parameters())}


def _states(sub, model_param) -> dict:
    """The main parameter and Adam's state behind ``model_param`` (only the parameter before the
    first step). Megatron's own accessor would look the state up in torch's ``defaultdict`` and so
    leave an empty state behind, which its ``state_dict()`` then takes for a stepped one."""
    group_index, group_order = sub.model_param_group_index_map[model_param]
    main_param = sub.optimizer.param_groups[group_index]["params"][group_order]
    if main_param not in sub.optimizer.state:
        return {"param": main_param}
    return sub._get_main_param_and_optimizer_states(model_param)


def read_part(optimizer, updates: int) -> Part:
    """This rank's part as it stands (Adam's moments are zeros before its first step)."""
    index, device = _param_index(optimizer), device_of(optimizer)
    pieces, values = [], []
    for sub, model_param, span in _ranges(optimizer):
        tensors = _states(sub, model_param)
        for key in KEYS:
            value = tensors.get(key)
            values.append(torch.zeros(span.size, device=device) if value is None
                          else value.detach().reshape(-1).float().to(device))
        pieces.append((*index[model_param], span.start, span.end))
    return Part(torch.tensor(pieces, dtype=torch.int64, device=device).reshape(-1, 4),
                torch.cat(values) if values else torch.zeros(0, device=device), updates)


def _sources(parts: list[Part]) -> dict:
    """(chunk, parameter) -> [(start, end, values [len(KEYS), end - start])] over ``parts``."""
    sources = defaultdict(list)
    for part in parts:
        offset = 0
        for chunk, param, start, end in part.pieces.tolist():
            size = end - start
            sources[(chunk, param)].append((start, end, part.values[offset:offset + len(KEYS) * size].view(len(KEYS), size)))
            offset += len(KEYS) * size
    return sources


@torch.no_grad()
def write_parts(optimizer, parts: list[Part]) -> None:
    """Fill this rank's range of every parameter from ``parts`` (which together cover it), after
    ``load_state_dict`` made the optimizer's state (its step counts, param groups, loss scale)."""
    sources = _sources(parts)
    index, device = _param_index(optimizer), device_of(optimizer)
    for sub, model_param, span in _ranges(optimizer):
        block = torch.empty(len(KEYS), span.size, device=device)
        covered = 0
        for start, end, values in sources[index[model_param]]:
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                block[:, lo - span.start:hi - span.start] = values[:, lo - start:hi - start]
                covered += hi - lo
        if covered != span.size:
            raise RuntimeError(f"the optimizer parts received cover {covered} of the {span.size} elements of "
                               f"parameter {index[model_param]} this rank holds")
        sub._set_main_param_and_optimizer_states(model_param, {k: block[j] for j, k in enumerate(KEYS)})


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is Megatron's distributed optimizer (each rank steps a part)."""
    return any(hasattr(sub, "gbuf_ranges") for sub in distributed_optimizers(optimizer))


def position_parts(optimizer, layout: Layout, rank: int, updates: int) -> list[Part]:
    """Every part of this rank's position in ``layout``: its own, and each other rank's, which
    they send (every rank of the world at once)."""
    own = read_part(optimizer, updates)
    peers = [r for r in part_ring(layout, rank) if r != rank]
    return [own, *_swap_parts([(own, peer) for peer in peers], peers, own.values.device)]


@torch.no_grad()
def whole_states(optimizer, parts: list[Part] | None = None) -> dict:
    """Model parameter -> its whole optimizer state, ``[len(KEYS), numel]`` float32, from ``parts``
    (which must cover every parameter), or zeros to be filled when ``parts`` is None. A re-plan
    that moves layers moves these: the model's layers change, and a part is addressed by them."""
    index, device = _param_index(optimizer), device_of(optimizer)
    states = {p: torch.zeros(len(KEYS), p.numel(), device=device) for p in index}
    if parts is None:
        return states
    sources = _sources(parts)
    for param, where in index.items():
        covered = 0
        for start, end, values in sources[where]:
            states[param][:, start:end] = values
            covered += end - start
        if covered != param.numel():
            raise RuntimeError(f"the optimizer parts of this position cover {covered} of the {param.numel()} elements "
                               f"of parameter {where}")
    return states


def whole_part(optimizer, states: dict, updates: int) -> Part:
    """``states`` (``whole_states``) as one part covering every parameter, for ``write_parts``."""
    index, device = _param_index(optimizer), device_of(optimizer)
    pieces = [(*where, 0, param.numel()) for param, where in index.items()]
    return Part(torch.tensor(pieces, dtype=torch.int64, device=device).reshape(-1, 4),
                torch.cat([states[param].reshape(-1) for param in index]) if index else torch.zeros(0, device=device),
                updates)


def regather(optimizer) -> None:
    """The model's parameters from the optimizer's main parameters, every rank's range gathered."""
    for sub in distributed_optimizers(optimizer):
        sub._copy_main_params_to_model_params()
    for chunk in optimizer.model_chunks:
        chunk.start_param_sync(force_sync=True)


class PartCopies:
    """This rank's update count, its part as it was before the update of the step in progress
    (``before``), and the copy it keeps of the previous rank's part (``held``, and ``held_earlier``,
    the one before).

    An optimizer step counts once its first parameter is updated (from then on the part differs
    from its copy), and its copies are sent once the step has returned: a failure in between
    leaves the copies an update behind, which a recovery sees and undoes (``agree_on_update``)."""

    def __init__(self, layout: Layout, rank: int, optimizer, updates: int = 0):
        self.optimizer = optimizer
        self.holder = copy_holder(layout, rank)
        self.owner = copied_owner(layout, rank)
        self.updates = updates
        self.before: Part | None = None  # this rank's part before the update of the step in progress
        self.held: Part | None = None  # the owner's part, as last received
        self.held_earlier: Part | None = None  # the one received before it
        self._counted = False  # this step's update is counted

    def step_begins(self) -> None:
        """The optimizer is about to step: keep the part as it stands, in case the update is undone."""
        self._counted = False
        self.before = read_part(self.optimizer, self.updates)

    def updating(self) -> bool:
        """One of the optimizer's parameter groups was updated (counted once per step). Returns
        whether this was the step's first."""
        if self._counted:
            return False
        self.updates += 1
        self._counted = True
        return True

    def step_returned(self) -> None:
        """Send the updated part's copies, if the step updated it, and wait until every rank's have
        landed (one world-wide all-reduce of one element). Until then no rank leaves its step, so a
        failure finds every rank still able to take its update back (``before``); after it,
        Megatron's loop counts the iteration, and every part and copy is of the new update."""
        if self._counted:
            self._counted = False
            self.send()
            dist.all_reduce(torch.zeros(1, device=device_of(self.optimizer)))

    def step_done(self) -> None:
        """Megatron's loop has counted the step's iteration: its update can no longer be undone."""
        self.before = None

    def send(self) -> None:
        """Send this rank's part to the rank keeping its copy and receive the part this rank keeps
        (every rank of the world at once)."""
        if self.holder is None:
            return
        own = read_part(self.optimizer, self.updates)
        received = _swap_parts([(own, self.holder)], [self.owner], own.values.device)[0]
        self.held_earlier, self.held = self.held, received

    def report(self) -> tuple[int, int | None, HeldCopy | None]:
        """(this rank's updates, those of its part kept from before its latest update, the copy it keeps)."""
        held = None if self.held is None else HeldCopy(
            self.owner, self.held.updates, None if self.held_earlier is None else self.held_earlier.updates)
        before = None if self.before is None or self.before.updates != self.updates - 1 else self.before.updates
        return self.updates, before, held

    def part_at(self, update: int) -> Part:
        """This rank's part of ``update``: as it stands, or as it was before its latest update."""
        if update == self.updates:
            return read_part(self.optimizer, self.updates)
        assert self.before is not None and self.before.updates == update, (update, self.updates)
        return self.before

    def held_at(self, update: int) -> Part:
        """The copy this rank keeps, of ``update``: the latest, or the one before it."""
        for part in (self.held, self.held_earlier):
            if part is not None and part.updates == update:
                return part
        raise AssertionError(f"no copy of update {update} kept")


def set_back_adam_steps(optimizer, steps: int) -> None:
    """Take ``steps`` off every Adam step count of ``optimizer``'s parts (an update undone)."""
    if steps <= 0:
        return
    for sub in distributed_optimizers(optimizer):
        for state in sub.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.sub_(steps)
            elif step is not None:
                state["step"] = step - steps


def _exchange(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives if t.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _swap_parts(outgoing: list[tuple[Part, int]], sources: list[int], device: torch.device) -> list[Part]:
    """Send each ``(part, peer)`` and receive one part from each of ``sources`` (peers' ranks in the
    current world), sizes first, so a receiver needs nothing of the sender's layout. Every member
    lists what it exchanges with one peer in the same order as that peer does."""
    def header(part: Part) -> torch.Tensor:
        return torch.tensor([part.pieces.shape[0], part.values.numel(), part.updates], dtype=torch.int64,
                            device=device)

    incoming = [torch.zeros(3, dtype=torch.int64, device=device) for _ in sources]
    _exchange([(header(part), peer) for part, peer in outgoing], list(zip(incoming, sources)))
    received = [Part(torch.empty(int(h[0]), 4, dtype=torch.int64, device=device),
                     torch.empty(int(h[1]), dtype=torch.float32, device=device), int(h[2])) for h in incoming]
    _exchange([(t, peer) for part, peer in outgoing for t in (part.pieces, part.values)],
              [(t, peer) for part, peer in zip(received, sources) for t in (part.pieces, part.values)])
    return received


class StagedParts(NamedTuple):
    """What ``stage_parts`` leaves a rank of the new world with.

    Attributes:
        parts: every part of its position, its own included (a standby: what it received), all of
            ``update``.
        optimizer_state: on a standby taken back, a live rank of its position's optimizer
            ``state_dict()`` (step counts, parameter groups, loss scaler), which shapes the state
            its parts are written into; None on every other rank, and before the first update.
        update: the update count the parts are of (every member's alike).
        steps_back: how many updates the Adam step counts this rank's rebuilt optimizer takes (its
            own, or on a standby ``optimizer_state``'s) are ahead of ``update``.
    """

    parts: list[Part]
    optimizer_state: dict | None = None
    update: int = 0
    steps_back: int = 0


def stage_parts(copies: PartCopies | None, layout: Layout, rank: int, sources: Mapping[int, int],
                kept: Mapping[int, int], peer_rank: Callable[[int], int], places: Mapping[int, int] | None = None,
                device: torch.device | None = None, seats: Mapping[int, int] | None = None) -> StagedParts | None:
    """In the world of every survivor (``peer_rank``: a ``layout`` rank's rank there): agree on the
    update the parts are brought to, then send every kept rank of each position the parts it lacks,
    of that update.

    Args:
        copies: this rank's part and held copy, in ``layout``; None on a standby taken back.
        sources: dead rank -> the live rank whose copy stands for its part.
        kept: old rank -> new rank, for the ranks that go on (standbys taken back included, numbered
            after ``layout``'s ranks).
        places: dead rank -> the standby taking its place: a standby receives every part of that
            position, and the lowest live rank of it sends the optimizer's other state.
        device: where a standby receives its parts (it has no optimizer yet).
        seats: standby -> a live rank of ``layout`` whose position it joins (a readmission's
            joiners, which take no dead rank's place); it receives as ``places``' standbys do.

    Returns:
        On a kept rank, every part of its position (``StagedParts``); None elsewhere.

    Raises:
        OptimizerPartsStale: on every member alike, when the parts cannot make one state.
    """
    places = dict(places or {})
    seat = {standby: dead for dead, standby in places.items()}  # a standby's place in ``layout``
    seat.update(seats or {})
    # Each standby taken back learns the optimizer's other state from the lowest live rank of its place.
    giver = {standby: min(r for r in part_ring(layout, place) if r not in sources)
             for standby, place in seat.items() if standby in kept}
    # (Before the first update there is none to give: the standby's fresh optimizer is the same.)
    gives = copies is not None and rank in giver.values() and copies.updates > 0
    state = copies.optimizer.state_dict() if gives else None
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (rank, None, None, None, state) if copies is None
                           else (rank, *copies.report(), state))
    holders = [r for r in reports if r[1] is not None]  # a standby holds no part
    agreed = agree_on_update({r: n for r, n, _, _, _ in holders}, {r: b for r, _, b, _, _ in holders},
                             {r: held for r, _, _, held, _ in holders}, sources)
    if isinstance(agreed, str):
        raise OptimizerPartsStale(agreed)
    sends = []  # (source, receiver, owner) in one order on every member
    for receiver in sorted(kept):
        for owner in part_ring(layout, seat.get(receiver, receiver)):
            source = sources.get(owner, owner)
            if owner != receiver and source != receiver:
                sends.append((source, receiver, owner))
    own = copies.part_at(agreed.update) if copies is not None else None
    held = copies.held_at(agreed.update) if copies is not None and copies.owner in agreed.earlier_copies else \
        copies.held if copies is not None else None
    outgoing = [(own if owner == rank else held, peer_rank(receiver))
                for source, receiver, owner in sends if source == rank]
    received = _swap_parts(outgoing, [peer_rank(source) for source, receiver, _ in sends if receiver == rank],
                           own.values.device if own is not None else device)
    if rank not in kept:
        return None
    if copies is None:
        given = next(r for r in reports if r[0] == giver[rank])
        return StagedParts(received, given[4], agreed.update, steps_back=given[1] - agreed.update if given[4] else 0)
    mine = [held] if held is not None and sources.get(copies.owner) == rank else []
    return StagedParts([own, *mine, *received], None, agreed.update, steps_back=copies.updates - agreed.update)
