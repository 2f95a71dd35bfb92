"""The Layout value object: which ranks run which layers, at which TP degree, in which replica.

A Layout describes every data-parallel replica separately (replicas may differ after an
adaptation): replica -> pipeline stages -> (contiguous layer range, TP group ranks in TP-rank
order). Under the interleaved schedule a stage's range counts its layers, and the model's layers
it holds lie apart, in its model chunks (``Layout.held_layers``). It validates itself on
construction, derives the gradient synchronisation sets that a heterogeneous layout needs, and
round-trips through plain JSON.

This module only describes placements. Building process groups from a Layout is the training
front end's job; nothing here imports ``megatron`` or ``torch.distributed``.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any, Iterable, Mapping

from resihp_ext.interleaved_split import check_chunks, chunk_layers, stage_layers


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of one replica.

    The stage holds layers ``[first_layer, first_layer + num_layers)`` (0-based; under the
    interleaved schedule, ``num_layers`` of the model's layers, which ``Layout.held_layers`` names)
    and its TP group is ``ranks`` in TP-rank order (``ranks[i]`` has TP rank ``i``).
    """

    first_layer: int
    num_layers: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.first_layer < 0 or self.num_layers < 1:
            raise ValueError(
                f"stage needs first_layer >= 0 and num_layers >= 1, got first_layer={self.first_layer}, "
                f"num_layers={self.num_layers}; give every stage at least one layer"
            )
        if not self.ranks:
            raise ValueError("stage has no ranks; a stage needs a TP group of at least one rank")

    @property
    def tp_degree(self) -> int:
        return len(self.ranks)

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def end_layer(self) -> int:
        return self.first_layer + self.num_layers


@dataclass(frozen=True)
class ReplicaSpec:
    """One data-parallel replica: its pipeline stages in pipeline order."""

    stages: tuple[StageSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for stage in self.stages for r in stage.ranks)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(stage.num_layers for stage in self.stages)

    def stage_holding(self, layer: int) -> StageSpec:
        """The stage of this replica that holds ``layer``."""
        for stage in self.stages:
            if stage.first_layer <= layer < stage.end_layer:
                return stage
        raise ValueError(f"layer {layer} is held by no stage of this replica")

    def relabel(self, new_rank: Mapping[int, int]) -> "ReplicaSpec":
        """The same replica with every rank renamed."""
        return ReplicaSpec(tuple(replace(s, ranks=tuple(new_rank[r] for r in s.ranks)) for s in self.stages))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form; ``ReplicaSpec.from_dict(r.to_dict()) == r``."""
        return {"stages": [{"first_layer": s.first_layer, "num_layers": s.num_layers, "ranks": list(s.ranks)}
                           for s in self.stages]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReplicaSpec":
        return cls(tuple(StageSpec(int(s["first_layer"]), int(s["num_layers"]), tuple(int(r) for r in s["ranks"]))
                         for s in data["stages"]))


@dataclass(frozen=True)
class ModelSpec:
    """The model facts needed for divisibility checks, memory and time estimates.

    ``global_batch_size`` is optional; when set it must be a multiple of ``micro_batch_size``.
    ``launch_chunks``: under the interleaved schedule, the decoder layers of each model chunk of each
    pipeline stage at launch (``resihp_ext.interleaved_split``): a stage then holds the model's layers
    its chunks give it, not one range. None: one chunk per stage.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int | None = None
    launch_chunks: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.launch_chunks is not None:
            object.__setattr__(self, "launch_chunks", tuple(tuple(int(n) for n in s) for s in self.launch_chunks))
            check_chunks(self.launch_chunks)
            if sum(map(sum, self.launch_chunks)) != self.num_layers:
                raise ValueError(f"ModelSpec.launch_chunks {self.launch_chunks} do not hold the model's "
                                 f"{self.num_layers} layers")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "seq_length", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; pick a head count that divides the hidden size"
            )
        gbs = self.global_batch_size
        if gbs is not None and (gbs < 1 or gbs % self.micro_batch_size):
            raise ValueError(
                f"global_batch_size {gbs} must be a positive multiple of micro_batch_size {self.micro_batch_size}"
            )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches in one global batch (summed over all replicas)."""
        if self.global_batch_size is None:
            raise ValueError("ModelSpec.global_batch_size is not set; pass it to count micro-batches")
        return self.global_batch_size // self.micro_batch_size

    def check_tp_degree(self, tp_degree: int) -> str | None:
        """Why ``tp_degree`` cannot shard this model, or None if it can."""
        if not is_power_of_two(tp_degree):
            return f"TP degree {tp_degree} is not a power of two"
        for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) % tp_degree:
                return f"TP degree {tp_degree} does not divide {name}={getattr(self, name)}"
        return None


def replica_shape(replica: ReplicaSpec) -> tuple:
    """Layers and TP degree of each stage: what two replicas must share to train alike."""
    return replica.layers_per_stage, tuple(s.tp_degree for s in replica.stages)


@dataclass(frozen=True)
class Layout:
    """All replicas of a job plus the model they train. Validated on construction."""

    replicas: tuple[ReplicaSpec, ...]
    model: ModelSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(
        cls,
        model: ModelSpec,
        tp_degree: int,
        pp_degree: int,
        dp_degree: int,
        layers_per_stage: tuple[int, ...] | None = None,
    ) -> "Layout":
        """Megatron-core's default layout, ranks in "tp-cp-ep-dp-pp" order.

        Global rank of TP rank ``t``, DP rank ``d``, pipeline stage ``p`` is
        ``t + tp_degree * (d + dp_degree * p)``.

        Args:
            model: the model facts.
            tp_degree: tensor-parallel size.
            pp_degree: pipeline-parallel size.
            dp_degree: data-parallel size (number of replicas).
            layers_per_stage: layers per stage (sums to ``model.num_layers``); default splits evenly,
                the first ``num_layers % pp_degree`` stages taking one extra layer.

        Returns:
            The validated Layout.
        """
        for name, value in (("tp_degree", tp_degree), ("pp_degree", pp_degree), ("dp_degree", dp_degree)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if layers_per_stage is None:
            if model.num_layers < pp_degree:
                raise ValueError(
                    f"num_layers {model.num_layers} < pp_degree {pp_degree}; use fewer pipeline stages"
                )
            base, extra = divmod(model.num_layers, pp_degree)
            layers_per_stage = tuple(base + (1 if p < extra else 0) for p in range(pp_degree))
        if len(layers_per_stage) != pp_degree:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_stage)} entries, expected pp_degree={pp_degree}"
            )
        replicas = []
        for d in range(dp_degree):
            stages, first = [], 0
            for p, num in enumerate(layers_per_stage):
                base_rank = tp_degree * (d + dp_degree * p)
                stages.append(StageSpec(first, num, tuple(range(base_rank, base_rank + tp_degree))))
                first += num
            replicas.append(ReplicaSpec(tuple(stages)))
        return cls(tuple(replicas), model)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the first problem: coverage, TP degree, or a reused rank."""
        if not self.replicas:
            raise ValueError("layout has no replicas; keep at least one data-parallel replica")
        seen: set[int] = set()
        for r, replica in enumerate(self.replicas):
            if not replica.stages:
                raise ValueError(f"replica {r} has no stages")
            expected = 0
            for s, stage in enumerate(replica.stages):
                if stage.first_layer != expected:
                    raise ValueError(
                        f"replica {r} stage {s} starts at layer {stage.first_layer}, expected {expected}: "
                        "stages must cover the layers contiguously, each exactly once"
                    )
                expected = stage.end_layer
                why = self.model.check_tp_degree(stage.tp_degree)
                if why:
                    raise ValueError(f"replica {r} stage {s}: {why}; use a power of two dividing heads, ffn and vocab")
                for rank in stage.ranks:
                    if rank < 0:
                        raise ValueError(f"replica {r} stage {s}: rank {rank} is negative")
                    if rank in seen:
                        raise ValueError(f"rank {rank} appears more than once in the layout; each rank holds one place")
                    seen.add(rank)
            if expected != self.model.num_layers:
                raise ValueError(
                    f"replica {r} covers layers [0, {expected}) but the model has {self.model.num_layers} layers"
                )

    # ------------------------------------------------------------------ queries
    @cached_property
    def _places(self) -> dict[int, tuple[int, int, int]]:
        # rank -> (replica, stage, tp rank); built once, the layout is immutable
        return {
            rank: (r, s, t)
            for r, replica in enumerate(self.replicas)
            for s, stage in enumerate(replica.stages)
            for t, rank in enumerate(stage.ranks)
        }

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def world_ranks(self) -> tuple[int, ...]:
        """Every rank the layout uses, sorted."""
        return tuple(sorted(self._places))

    @property
    def world_size(self) -> int:
        return len(self._places)

    def _place(self, rank: int) -> tuple[int, int, int]:
        try:
            return self._places[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not part of this layout") from None

    def replica_of(self, rank: int) -> int:
        return self._place(rank)[0]

    def stage_of(self, rank: int) -> tuple[int, int]:
        """(replica index, stage index) of ``rank``."""
        r, s, _ = self._place(rank)
        return r, s

    def tp_rank_of(self, rank: int) -> int:
        return self._place(rank)[2]

    def stage_spec_of(self, rank: int) -> StageSpec:
        r, s, _ = self._place(rank)
        return self.replicas[r].stages[s]

    def held_layers(self, replica: int) -> tuple[tuple[int, ...], ...]:
        """The model's layer numbers each stage of replica ``replica`` holds: its range, or under the
        interleaved schedule (``ModelSpec.launch_chunks``) what its chunks hold for the replica's split.

        Raises:
            ValueError: under the interleaved schedule, a replica with another stage count than the launch's.
        """
        spec = self.replicas[replica]
        chunks = self.model.launch_chunks
        if chunks is None:
            return tuple(tuple(stage.layers) for stage in spec.stages)
        if spec.num_stages != len(chunks):
            raise ValueError(f"replica {replica} has {spec.num_stages} stages; the interleaved schedule's chunks "
                             f"are laid out over the launch's {len(chunks)}")
        return stage_layers(chunk_layers(chunks, spec.layers_per_stage))

    def contains(self, rank: int) -> bool:
        return rank in self._places

    def with_replicas(self, replicas: Iterable[ReplicaSpec]) -> "Layout":
        return replace(self, replicas=tuple(replicas))

    def relabel(self, new_rank: Mapping[int, int]) -> "Layout":
        """The same layout with every rank renamed (a re-formed world numbers its ranks densely)."""
        return self.with_replicas(rep.relabel(new_rank) for rep in self.replicas)

    def without_replicas(self, indices: Iterable[int]) -> "Layout":
        """The layout with the given replicas removed (their ranks become unused)."""
        drop = set(indices)
        return self.with_replicas(rep for i, rep in enumerate(self.replicas) if i not in drop)

    def replicas_touching(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Sorted indices of the replicas that use any of ``ranks``."""
        return tuple(sorted({self._places[r][0] for r in ranks if r in self._places}))

    # ------------------------------------------------------------------ shape
    def replicas_alike(self) -> bool:
        """Whether every replica has one shape (megatron-core's DDP can then sync their gradients)."""
        return len({replica_shape(r) for r in self.replicas}) == 1

    def replicas_line_up(self) -> bool:
        """Whether every replica has as many stages, whatever layers each stage holds and at
        whatever TP degree: their ranks then line up in megatron-core's data-parallel groups by
        (stage, TP rank), a replica at a smaller degree having no rank at the larger TP ranks."""
        return len({r.num_stages for r in self.replicas}) == 1

    def tp_degrees_descend(self) -> bool:
        """Whether replicas at a smaller TP degree follow those at larger ones in rank order: at
        every stage each rank of a replica at a larger degree comes before every rank of one at a
        smaller degree, and the world's last rank runs at the smallest degree. Megatron-core's
        data-parallel groups (by stage and TP rank, sorted) then have a largest-degree rank first
        (rank 0 writes the checkpoint) and the last rank's group holds every replica (it logs the
        loss). True where every replica runs at one degree."""
        degree = [r.stages[0].tp_degree for r in self.replicas]
        if len(set(degree)) <= 1:
            return True
        if not self.replicas_line_up():
            return False
        for s in range(self.replicas[0].num_stages):
            ranks = [r.stages[s].ranks for r in self.replicas]
            for a, b in itertools.permutations(range(len(self.replicas)), 2):
                if degree[a] > degree[b] and max(ranks[a]) > min(ranks[b]):
                    return False
        last = self.replica_of(max(self.world_ranks))
        return degree[last] == min(degree)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form; ``Layout.from_dict(l.to_dict()) == l``."""
        return {"model": asdict(self.model), "replicas": [rep.to_dict() for rep in self.replicas]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Layout":
        try:
            model = ModelSpec(**data["model"])
            replicas = tuple(ReplicaSpec.from_dict(rep) for rep in data["replicas"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a layout dict ({exc}); expected keys model, replicas[].stages[]") from None
        return cls(replicas, model)


__all__ = ["ModelSpec", "StageSpec", "ReplicaSpec", "Layout", "is_power_of_two", "replica_shape"]
