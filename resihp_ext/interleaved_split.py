"""Layer splits under the interleaved schedule: which model chunk holds which of the model's layers.

Under the interleaved schedule every pipeline stage runs several model chunks, and megatron-core
numbers the model's layers chunk by chunk across the stages: chunk 0 of stage 0, chunk 0 of
stage 1, ..., chunk 1 of stage 0, ... A stage's layers are therefore not consecutive, and a layer
reaches another stage only across the border between two chunks next to each other in that order.

Responsible for the chunk sizes that give each stage the number of layers a plan asks for while
shifting the fewest layers across chunk borders from the launch's chunks (``chunk_layers``), and
for the model's layers each stage then holds (``stage_layers``). Chunks are sized from the launch's
alone, so every rank, a spare taken back and a resumed job size them alike for one split.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

Chunks = tuple[tuple[int, ...], ...]  # per pipeline stage, the decoder layers of each of its chunks


def _model_order(chunks: Chunks) -> list[tuple[int, int]]:
    """(stage, chunk) in the order megatron-core numbers layers."""
    return [(p, v) for v in range(len(chunks[0])) for p in range(len(chunks))]


def check_chunks(chunks: Chunks) -> None:
    """Raise ValueError unless ``chunks`` is a stage-by-chunk grid of layer counts."""
    if not chunks or not chunks[0] or len({len(stage) for stage in chunks}) != 1:
        raise ValueError(f"chunks {chunks} must give every pipeline stage the same number of chunks, at least one")
    if any(n < 0 for stage in chunks for n in stage):
        raise ValueError(f"chunks {chunks} hold a negative layer count")


@lru_cache(maxsize=4096)
def stage_layers(chunks: Chunks) -> tuple[tuple[int, ...], ...]:
    """The model's layer numbers each stage holds, chunk by chunk (cached: the planner's search asks
    ``shard_map.holders`` for them once per candidate layout)."""
    check_chunks(chunks)
    held: list[list[int]] = [[] for _ in chunks]
    first = 0
    for p, v in _model_order(chunks):
        held[p].extend(range(first, first + chunks[p][v]))
        first += chunks[p][v]
    return tuple(tuple(layers) for layers in held)


@lru_cache(maxsize=4096)
def chunk_layers(launch: Chunks, layers_per_stage: tuple[int, ...]) -> Chunks:
    """Chunk sizes giving stage ``p`` ``layers_per_stage[p]`` layers, reached from the launch's
    chunks by the fewest layer shifts across chunk borders (a chunk may be left empty: megatron-core
    passes the activations through it).

    A shift of ``f`` layers across the border after chunk ``i`` of the model order moves its last
    ``f`` layers into the chunk after it (``f < 0``: the other way). The shifts are the unknowns of a
    small integer program: the chunk sizes they leave are non-negative and add up to each stage's
    count; the sum of ``|f|`` is minimised first (every layer shifted is state to send), then the
    largest chunk (the interleaved schedule runs best on even chunks), and the last ties go to the
    earliest borders, so the answer is one answer.

    Raises:
        ValueError: a split whose stage count or layer total is not the launch's.
    """
    from scipy.optimize import LinearConstraint, milp

    check_chunks(launch)
    num_layers = sum(map(sum, launch))
    if len(layers_per_stage) != len(launch) or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 0:
        raise ValueError(f"layers per stage {layers_per_stage} do not split the launch's {num_layers} layers over "
                         f"{len(launch)} stages")
    if tuple(map(sum, launch)) == tuple(layers_per_stage):
        return tuple(tuple(stage) for stage in launch)
    order = _model_order(launch)
    size = np.array([launch[p][v] for p, v in order], dtype=float)
    borders = len(order) - 1
    # change[i, j]: how chunk i's size moves with the shift across border j (x = [f+, f-]).
    change = np.zeros((len(order), borders))
    for j in range(borders):
        change[j, j], change[j + 1, j] = -1.0, 1.0
    change = np.hstack([change, -change])
    stage_rows = np.array([[1.0 if p == q else 0.0 for q, _ in order] for p in range(len(launch))])
    wanted = np.array(layers_per_stage, dtype=float) - stage_rows @ size
    # Weights that rank the objectives: a shift outweighs any change of the largest chunk, which
    # outweighs any choice between borders.
    largest_weight = 1.0 / (2.0 * (num_layers + 1))
    tie = largest_weight / (2.0 * (num_layers + 1) * max(borders, 1) ** 2)
    weights = np.array([1.0 + tie * j for j in range(borders)] * 2 + [largest_weight])
    below_largest = np.hstack([change, -np.ones((len(order), 1))])  # size + change @ x <= largest
    with_largest = np.hstack([change, np.zeros((len(order), 1))])
    found = milp(weights, integrality=np.ones(2 * borders + 1),
                 constraints=[LinearConstraint(with_largest, -size, np.inf),
                              LinearConstraint(below_largest, -np.inf, -size),
                              LinearConstraint(stage_rows @ with_largest, wanted, wanted)],
                 bounds=(0, num_layers))
    if not found.success:  # every split of the right total is reachable: a solver failure, not the input's
        raise RuntimeError(f"no chunk sizes found for {layers_per_stage} from {launch}: {found.message}")
    shifts = np.rint(found.x[:borders] - found.x[borders:2 * borders]).astype(int)
    sizes = (size + change[:, :borders] @ shifts).astype(int)
    out = [[0] * len(launch[0]) for _ in launch]
    for (p, v), n in zip(order, sizes):
        out[p][v] = int(n)
    return tuple(tuple(stage) for stage in out)


__all__ = ["Chunks", "check_chunks", "chunk_layers", "stage_layers"]
