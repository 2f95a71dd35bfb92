"""Per-device memory model of a pipeline stage, and the layer caps it implies.

Responsible for answering "does a stage with these layers at this TP degree fit on one device?":
model state (weights, gradients, optimizer state) divided by TP degree, a distributed optimizer's
share divided by the data-parallel degree too, plus activations of the micro-batches a 1F1B stage
keeps in flight (with sequence parallelism, flash attention or recomputation where the job uses
them), and the state a Megatron job keeps per parameter (``megatron_state_bytes``). An estimate of
what the job's tensors need, never an allocation: workspaces and fragmentation are left out.
"""

from __future__ import annotations

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.hardware import HardwareModel


def megatron_state_bytes(*, half_precision: bool, grads_in_fp32: bool, distributed_optimizer: bool) -> dict[str, float]:
    """Bytes a Megatron job with Adam keeps per parameter, as ``HardwareModel`` fields.

    A weight (2 bytes in bf16/fp16, else 4), its gradient buffer (4 bytes when gradients are
    accumulated in fp32, else the weight's), and the optimizer's state: Adam's two moments and,
    for half-precision weights, an fp32 master copy. A distributed optimizer splits that state
    over the data-parallel group (``sharded_state_bytes_per_param``).
    """
    weight = 2.0 if half_precision else 4.0
    grad = 4.0 if grads_in_fp32 or not half_precision else weight
    optimizer = 8.0 + (4.0 if half_precision else 0.0)
    if distributed_optimizer:
        return {"state_bytes_per_param": weight + grad, "sharded_state_bytes_per_param": optimizer}
    return {"state_bytes_per_param": weight + grad + optimizer, "sharded_state_bytes_per_param": 0.0}


def activation_bytes_per_layer(model: ModelSpec, hw: HardwareModel, tp_degree: int) -> float:
    """Activation bytes one layer keeps for one micro-batch at TP degree ``tp_degree``.

    The per-layer counts of the activation-memory analysis of Megatron's tensor parallelism, in
    values of 2 bytes rescaled to ``hw.activation_bytes_per_value``: ``s*b*h*(10 + 24/t)`` for
    what layer norms, dropouts and the TP-split matmuls keep (``34/t`` when sequence parallelism
    splits the first term too), plus ``5*a*s/(h*t)`` for the attention scores where they are kept;
    ``2*s*b*h`` (``/t`` with sequence parallelism), the layer's input alone, under full
    recomputation.
    """
    s, b, h, a = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads
    t = tp_degree
    if hw.recomputes_layers:
        values_x2 = 2 * s * b * h / (t if hw.sequence_parallel else 1)
    else:
        per_token = 34 / t if hw.sequence_parallel else 10 + 24 / t
        if hw.keeps_attention_scores:
            per_token += 5 * a * s / (h * t)
        values_x2 = s * b * h * per_token
    return values_x2 / 2 * hw.activation_bytes_per_value


def in_flight_microbatches(num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at its peak."""
    return max(1, min(num_stages - stage, num_microbatches))


def stage_memory_bytes(
    model: ModelSpec,
    hw: HardwareModel,
    *,
    num_layers: int,
    tp_degree: int,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    dp_degree: int = 1,
) -> float:
    """Peak bytes on one device of a stage.

    Args:
        model: model facts.
        hw: memory constants.
        num_layers: transformer layers on the stage.
        tp_degree: TP degree of the stage.
        stage: stage index (the first holds the embedding, the last the output layer).
        num_stages: pipeline depth of the replica.
        num_microbatches: micro-batches the replica runs per iteration (bounds in-flight ones).
        dp_degree: ranks of the stage's data-parallel group, over which a distributed optimizer
            splits its state (1, the most a rank may hold, where the count is not known).

    Returns:
        Bytes per device.
    """
    params = num_layers * hw.layer_params(model)
    if stage == 0:
        params += hw.embedding_params(model)
    if stage == num_stages - 1:
        params += model.vocab_size * model.hidden_size
    state = params * (hw.state_bytes_per_param + hw.sharded_state_bytes_per_param / dp_degree) / tp_degree
    inflight = in_flight_microbatches(num_stages, stage, num_microbatches)
    return state + num_layers * inflight * activation_bytes_per_layer(model, hw, tp_degree)


def _stage_bytes(layout: Layout, replica: int, position: int, hw: HardwareModel) -> float:
    # A stage of ``layout``, its data-parallel degree the layout's replica count (replicas alike).
    stages = layout.replicas[replica].stages
    return stage_memory_bytes(layout.model, hw, num_layers=stages[position].num_layers,
                              tp_degree=stages[position].tp_degree, stage=position, num_stages=len(stages),
                              num_microbatches=layout.model.num_microbatches, dp_degree=layout.num_replicas)


def largest_stage_bytes(layout: Layout, hw: HardwareModel) -> float:
    """The most bytes any stage of ``layout`` needs on one device, each stage's data-parallel degree
    taken as the layout's replica count (replicas alike)."""
    return max(_stage_bytes(layout, r, p, hw) for r, replica in enumerate(layout.replicas)
               for p in range(replica.num_stages))


def outgrown_stages(before: Layout, after: Layout, hw: HardwareModel) -> tuple[int, ...]:
    """Stage positions whose estimate on ``after`` (replicas alike, as under a distributed optimizer)
    is above ``hw.device_memory_bytes`` and above that stage's on ``before``: fewer replicas give
    each rank a larger share of the optimizer state. A stage that needs no more than it did is not
    counted (the job ran it, whatever the estimate says)."""
    needs = [(p, _stage_bytes(after, 0, p, hw)) for p in range(after.replicas[0].num_stages)]
    return tuple(p for p, need in needs
                 if need > hw.device_memory_bytes and need > _stage_bytes(before, 0, p, hw))


def max_layers_on_stage(
    model: ModelSpec,
    hw: HardwareModel,
    *,
    tp_degree: int,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    dp_degree: int = 1,
) -> int:
    """Most layers a stage can hold within ``hw.device_memory_bytes`` (0 if not even one fits)."""
    kwargs = dict(tp_degree=tp_degree, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches,
                  dp_degree=dp_degree)
    fixed = stage_memory_bytes(model, hw, num_layers=0, **kwargs)
    per_layer = stage_memory_bytes(model, hw, num_layers=1, **kwargs) - fixed
    room = hw.device_memory_bytes - fixed
    if room < per_layer:
        return 0
    # memory is affine in the layer count, so the cap is a floor division
    return min(model.num_layers, int(room // per_layer))
