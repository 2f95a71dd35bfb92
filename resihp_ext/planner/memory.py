"""Per-device memory model of a pipeline stage, and the layer caps it implies.

Responsible for answering "does a stage with these layers at this TP degree fit on one device?":
model state (weights, gradients, Adam state) divided by TP degree, plus activations of the
micro-batches a 1F1B stage keeps in flight. Deliberately simple and conservative (no sequence
parallelism, no recomputation, no distributed optimizer); it never allocates anything.
"""

from __future__ import annotations

from resihp_ext.layout import ModelSpec
from resihp_ext.planner.hardware import HardwareModel


def activation_bytes_per_layer(model: ModelSpec, hw: HardwareModel, tp_degree: int) -> float:
    """Activation bytes one layer keeps for one micro-batch at TP degree ``tp_degree``.

    Uses the per-layer count ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` values of 2 bytes (bf16) from
    the activation-memory analysis of Megatron's TP without sequence parallelism, rescaled to
    ``hw.activation_bytes_per_value``.
    """
    s, b, h, a = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads
    values_x2 = s * b * h * (10 + 24 / tp_degree + 5 * a * s / (h * tp_degree))
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

    Returns:
        Bytes per device.
    """
    params = num_layers * hw.layer_params(model)
    if stage == 0:
        params += hw.embedding_params(model)
    if stage == num_stages - 1:
        params += model.vocab_size * model.hidden_size
    state = params * hw.state_bytes_per_param / tp_degree
    inflight = in_flight_microbatches(num_stages, stage, num_microbatches)
    return state + num_layers * inflight * activation_bytes_per_layer(model, hw, tp_degree)


def max_layers_on_stage(
    model: ModelSpec,
    hw: HardwareModel,
    *,
    tp_degree: int,
    stage: int,
    num_stages: int,
    num_microbatches: int,
) -> int:
    """Most layers a stage can hold within ``hw.device_memory_bytes`` (0 if not even one fits)."""
    kwargs = dict(tp_degree=tp_degree, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches)
    fixed = stage_memory_bytes(model, hw, num_layers=0, **kwargs)
    per_layer = stage_memory_bytes(model, hw, num_layers=1, **kwargs) - fixed
    room = hw.device_memory_bytes - fixed
    if room < per_layer:
        return 0
    # memory is affine in the layer count, so the cap is a floor division
    return min(model.num_layers, int(room // per_layer))
