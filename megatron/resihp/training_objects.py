"""What one rank trains, as the executor hands it between worlds.

Responsible for ``TrainingObjects``, the megatron-core objects a rank holds for training (its model
chunks wrapped in DDP, the optimizer, the LR scheduler, and the layer split they were built for),
replaced whole on every rebuild, and for ``pipeline_layout``, megatron-core's per-chunk layer list
of a split. The objects are built by Megatron's ``get_model`` and optimizer set-up
(``megatron_loop_stages.build_objects``); nothing here builds or creates process groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig


@dataclasses.dataclass
class TrainingObjects:
    """What a rank holds for training; replaced whole on every rebuild."""

    config: TransformerConfig
    chunks: tuple[DistributedDataParallel, ...]  # the model's chunks on this rank: one per virtual stage
    optimizer: Any
    scheduler: OptimizerParamScheduler
    layers_per_stage: tuple[int, ...]

    @property
    def model(self) -> DistributedDataParallel:
        """The one model chunk of a rank that runs one (every rank outside the interleaved schedule)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank runs {len(self.chunks)} model chunks (the interleaved schedule): "
                             f"address them through TrainingObjects.chunks")
        return self.chunks[0]


def pipeline_layout(layers_per_stage: tuple[int, ...], chunks: tuple[tuple[int, ...], ...] | None = None) -> list[list[str]]:
    """megatron-core's layer list of a split, one list per model chunk in its order (under the
    interleaved schedule, ``chunks``: every stage's chunk 0, then every stage's chunk 1, ...):
    embedding first, loss last, decoders between."""
    if chunks is None:
        lists = [["decoder"] * n for n in layers_per_stage]
    else:
        lists = [["decoder"] * chunks[p][v] for v in range(len(chunks[0])) for p in range(len(chunks))]
    lists[0].insert(0, "embedding")
    lists[-1].append("loss")
    return lists
