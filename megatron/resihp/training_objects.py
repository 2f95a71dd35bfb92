"""What one rank trains, as the executor hands it between worlds.

Responsible for ``TrainingObjects``, the megatron-core objects a rank holds for training (its model
chunks wrapped in DDP, the optimizer, the LR scheduler, and the layer split they were built for),
replaced whole on every rebuild, and for ``pipeline_layout``, megatron-core's per-stage layer list
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
    # The Layout's number of each of megatron-core's layers (by its ``layer_number - 1``), where they
    # differ: the interleaved schedule places a stage's layers apart, and a Layout numbers them stage
    # by stage. None: the same numbers.
    layout_layer_of: tuple[int, ...] | None = None

    @property
    def model(self) -> DistributedDataParallel:
        """The one model chunk of a rank that runs one (every rank outside the interleaved schedule)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank runs {len(self.chunks)} model chunks (the interleaved schedule): "
                             f"address them through TrainingObjects.chunks")
        return self.chunks[0]


def pipeline_layout(layers_per_stage: tuple[int, ...]) -> list[list[str]]:
    """megatron-core's per-stage layer list: embedding first, loss last, decoders between."""
    stages = [["decoder"] * n for n in layers_per_stage]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages
