"""The cost model's constants: compute, TP efficiency, bandwidth, memory and adaptation costs.

Responsible for ``HardwareModel``, a frozen record of the numbers the planner multiplies with
(defaults describe an A100-80GB cluster on 200 Gb/s links), and the derived per-layer quantities
of a GPT model (parameters, forward seconds, activation bytes). No search happens here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_ext.layout import ModelSpec
from resihp_ext.schedule import Interleaving


@dataclass(frozen=True, kw_only=True)
class HardwareModel:
    """Numbers the planner's cost model uses.

    Attributes:
        device_flops: sustained FLOP/s of one healthy device.
        layer_forward_s: forward seconds of one transformer layer for one micro-batch at TP=1 and
            speed 1; None derives it from the model's FLOPs and ``device_flops``.
        backward_factor: backward time / forward time.
        tp_efficiency: parallel efficiency kept per doubling of TP degree (TP=k runs
            ``k * tp_efficiency**log2(k)`` times faster than TP=1); the lost share is communication.
        include_embedding_cost: charge the output layer + loss to the last stage's time (the
            embedding lookup on the first stage is memory-bound and counted as free).
        output_forward_s: forward seconds of the output layer + loss for one micro-batch at TP=1
            (measured); None derives it from ``layer_forward_s`` by the FLOP ratio.
        link_bandwidth_Bps: bytes/s of one inter-node link (p2p, state moves, gradient sync).
        overlap_p2p: pipeline transfers run beside compute. False (Megatron's default 1F1B, where
            every send/receive is waited on before the next op): a transfer lengthens the op
            that sends it, so a slow link slows both stages it joins.
        device_memory_bytes: usable memory of one device.
        state_bytes_per_param: bytes every rank keeps per parameter of its TP shard (bf16 weight +
            fp32 grad + fp32 master + Adam m, v without a distributed optimizer).
        sharded_state_bytes_per_param: bytes per parameter that a distributed optimizer splits over
            a stage's data-parallel group (fp32 master + Adam m, v): each rank keeps its 1/DP share.
        sequence_parallel: activations outside attention and MLP are split over the TP group too.
        keeps_attention_scores: the attention's softmax input and output are kept for the backward
            (an unfused attention without recomputation; flash attention and selective
            recomputation keep none).
        recomputes_layers: full recomputation of every layer: a layer keeps only its input.
        grad_bytes_per_param: bytes per parameter in the data-parallel gradient all-reduce.
        activation_bytes_per_value: bytes per activation value (bf16).
        regroup_s: fixed seconds to re-form process groups when a plan changes the layout.
        restart_s: seconds a checkpoint-restart costs (save/detect, relaunch, reload).
        interleaving: the pipeline schedule replicas run (1F1B, or the interleaved one with its
            model chunks per stage): plans are priced under it, and quotas kept to counts it runs.
    """

    device_flops: float = 150e12
    layer_forward_s: float | None = None
    backward_factor: float = 2.0
    tp_efficiency: float = 0.93
    include_embedding_cost: bool = True
    output_forward_s: float | None = None
    link_bandwidth_Bps: float = 25e9
    overlap_p2p: bool = False
    device_memory_bytes: float = 80e9
    state_bytes_per_param: float = 18.0
    sharded_state_bytes_per_param: float = 0.0
    sequence_parallel: bool = False
    keeps_attention_scores: bool = True
    recomputes_layers: bool = False
    grad_bytes_per_param: float = 2.0
    activation_bytes_per_value: float = 2.0
    regroup_s: float = 5.0
    restart_s: float = 600.0
    interleaving: Interleaving = Interleaving()

    def __post_init__(self) -> None:
        for name in ("device_flops", "backward_factor", "link_bandwidth_Bps", "device_memory_bytes",
                     "state_bytes_per_param", "activation_bytes_per_value"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HardwareModel.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.tp_efficiency <= 1.0:
            raise ValueError(f"HardwareModel.tp_efficiency must be in (0, 1], got {self.tp_efficiency}")
        for name in ("regroup_s", "restart_s", "grad_bytes_per_param", "sharded_state_bytes_per_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"HardwareModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.layer_forward_s is not None and self.layer_forward_s <= 0:
            raise ValueError(f"HardwareModel.layer_forward_s must be > 0 or None, got {self.layer_forward_s}")
        if self.output_forward_s is not None and self.output_forward_s < 0:
            raise ValueError(f"HardwareModel.output_forward_s must be >= 0 or None, got {self.output_forward_s}")

    # ------------------------------------------------------------------ model-derived quantities
    @staticmethod
    def layer_params(model: ModelSpec) -> int:
        """Parameters of one transformer layer (attention, MLP, two layer norms, biases)."""
        h, f = model.hidden_size, model.ffn_hidden_size
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @staticmethod
    def embedding_params(model: ModelSpec) -> int:
        """Word + position embedding (first stage); the last stage holds a vocab x hidden output copy."""
        return (model.vocab_size + model.seq_length) * model.hidden_size

    def layer_forward_tp1_s(self, model: ModelSpec) -> float:
        if self.layer_forward_s is not None:
            return self.layer_forward_s
        tokens = model.micro_batch_size * model.seq_length
        # 2 FLOPs per parameter per token, plus the two s x s attention matmuls
        flops = 2 * tokens * self.layer_params(model) + 4 * tokens * model.seq_length * model.hidden_size
        return flops / self.device_flops

    def output_forward_tp1_s(self, model: ModelSpec) -> float:
        """Output projection + loss forward seconds at TP=1 (0 when embedding cost is excluded)."""
        if not self.include_embedding_cost:
            return 0.0
        if self.output_forward_s is not None:
            return self.output_forward_s
        # the output projection is a hidden x vocab matmul; scale the layer's time by the FLOP ratio
        ratio = model.vocab_size / (4 * model.hidden_size + 2 * model.ffn_hidden_size)
        return self.layer_forward_tp1_s(model) * ratio

    def tp_speedup(self, tp_degree: int) -> float:
        """How many times faster TP=k computes than TP=1 on healthy devices and links."""
        return tp_degree * self.tp_efficiency ** math.log2(tp_degree)

    def comm_share(self, tp_degree: int) -> float:
        """Share of a TP=k stage's time spent in TP communication (0 at TP=1)."""
        return 1.0 - self.tp_efficiency ** math.log2(tp_degree)

    def boundary_bytes(self, model: ModelSpec) -> float:
        """Bytes of one micro-batch's activation crossing a pipeline boundary."""
        return model.micro_batch_size * model.seq_length * model.hidden_size * self.activation_bytes_per_value

    def p2p_s(self, model: ModelSpec, link_speed: float = 1.0) -> float:
        return self.boundary_bytes(model) / (self.link_bandwidth_Bps * link_speed)
