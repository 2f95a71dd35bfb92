"""What the planner's memory model reads from a Megatron job's flags (``memory_facts``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.resihp.memory_facts import job_memory_facts, memory_line
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.memory import largest_stage_bytes


def megatron_args(**changes) -> argparse.Namespace:
    args = argparse.Namespace(bf16=False, fp16=False, accumulate_allreduce_grads_in_fp32=False,
                              use_distributed_optimizer=False, sequence_parallel=False, recompute_granularity=None,
                              recompute_method=None, recompute_modules=None, transformer_impl="local",
                              attention_backend=None)
    vars(args).update(changes)
    return args


def test_a_bf16_job_with_the_distributed_optimizer_on_a_sized_device():
    facts = job_memory_facts(megatron_args(bf16=True, accumulate_allreduce_grads_in_fp32=True,
                                           use_distributed_optimizer=True, sequence_parallel=True), 40.0)
    assert facts == dict(state_bytes_per_param=6.0, sharded_state_bytes_per_param=12.0, device_memory_bytes=40 * 2**30,
                         activation_bytes_per_value=2.0, sequence_parallel=True, keeps_attention_scores=True,
                         recomputes_layers=False)
    HardwareModel(**facts)  # every fact is a field of the planner's model


@pytest.mark.parametrize("changes, kept", [
    ({}, True),  # megatron-core's local attention keeps the scores for its backward
    ({"transformer_impl": "transformer_engine"}, False),  # Transformer Engine picks a flash or fused kernel
    ({"recompute_granularity": "selective"}, False),  # the core attention recomputed
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, True),
])
def test_attention_scores_are_counted_where_the_backward_keeps_them(changes, kept):
    assert job_memory_facts(megatron_args(**changes), 1.0)["keeps_attention_scores"] is kept


def test_full_recomputation_counts_a_layers_input_alone_under_the_uniform_method():
    assert job_memory_facts(megatron_args(recompute_granularity="full", recompute_method="uniform"), 1.0)[
        "recomputes_layers"]
    assert not job_memory_facts(megatron_args(recompute_granularity="full", recompute_method="block"), 1.0)[
        "recomputes_layers"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: its own memory is read")
def test_without_a_size_or_cuda_the_reference_device_is_assumed():
    assert job_memory_facts(megatron_args(), None)["device_memory_bytes"] == HardwareModel.device_memory_bytes


def test_the_start_line_says_what_plans_are_sized_with_and_when_the_launch_is_estimated_above_it():
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=1, global_batch_size=8)
    launch = Layout.uniform(model, 2, 2, 2)
    need = largest_stage_bytes(launch, HardwareModel())
    roomy = memory_line(HardwareModel(device_memory_bytes=2 * 2**30), launch)
    assert "plans sized for 2 GiB a device" in roomy and f"estimated at {need / 2**30:.3g} GiB" in roomy
    assert "above the device" not in roomy
    assert "above the device" in memory_line(HardwareModel(device_memory_bytes=need / 2), launch)
