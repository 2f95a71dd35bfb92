"""State moves as production runs them: the transfers of ``resihp_ext.shard_map`` executed by
``megatron.resihp.reshard`` between real megatron-core stages on gloo ranks.

PP2 on two ranks: rank 0 runs layers 0-1, rank 1 layers 2-3. The new layout hands layer 1 to
rank 1 (rank 0 keeps layer 0). Both ways the executor moves state are run: in the same world
(``apply_transfers``, a fail-slow repartition or a readmission) and staged before a re-form
(``stage_transfers`` then ``unstage_transfers``, a plan that leaves ranks out or a fail-stop
takeover). Weights and Adam moments must arrive exactly, and each rank must run exactly the
transfers that involve it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.shard_map import transfers
from tests.cli_args import TINY_CPU_ARGS
from tests.dist.ranks import GROUP_TIMEOUT_S, run_ranks

MODEL = ModelSpec(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                  seq_length=8, micro_batch_size=1, global_batch_size=1)
OLD = Layout.uniform(MODEL, tp_degree=1, pp_degree=2, dp_degree=1)  # rank 0: layers 0-1, rank 1: layers 2-3
NEW = Layout((ReplicaSpec((StageSpec(0, 1, (0,)), StageSpec(1, 3, (1,)))),), MODEL)


def _state(objects) -> dict[str, list[list[float]]]:
    """Each parameter (by unsharded name) with its Adam moments, as plain lists (tensors would travel
    back from the rank processes as shared memory that is gone once they exit)."""
    from megatron.resihp.layer_sync import param_slots
    from megatron.resihp.reshard import _adam_state

    out = {}
    for slot in param_slots(objects.model.module):
        adam = _adam_state(objects.optimizer, slot.param, None) or {}
        moments = [adam[k] for k in ("exp_avg", "exp_avg_sq") if k in adam]
        out[slot.name] = [t.detach().double().flatten().tolist() for t in (slot.param, *moments)]
    return out


def _move_rank(rank, world_size, store, staged):
    from megatron.core import tensor_parallel

    from megatron.resihp import parallel_state_patch as patch
    from megatron.resihp.arguments import parse_args
    from megatron.resihp.model_builder import build_training_objects
    from megatron.resihp.reshard import apply_transfers, stage_transfers, unstage_transfers

    args = parse_args([*TINY_CPU_ARGS, "--num-layers", "4", "--pipeline-model-parallel-size", "2"], world_size=2)
    old_groups = patch.build_groups(OLD, rank, timeout=GROUP_TIMEOUT_S)
    patch.install(old_groups)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    old = build_training_objects(args, OLD.replicas[0].layers_per_stage)
    # One Adam step on made-up gradients, so that the moments are worth moving.
    generator = torch.Generator().manual_seed(rank)
    for param in old.model.module.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    assert old.optimizer.step()[0]
    before = _state(old)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, before)

    plan = transfers(OLD, NEW)
    ran: list = []
    received = stage_transfers(plan, OLD, rank, old, peer_rank=lambda r: r, ran=ran) if staged else None
    new_groups = patch.build_groups(NEW, rank, timeout=GROUP_TIMEOUT_S)
    patch.install(new_groups)
    new = build_training_objects(args, NEW.replicas[0].layers_per_stage)
    if staged:
        unstage_transfers(plan, OLD, NEW, rank, old, new, received)
    else:
        apply_transfers(plan, OLD, NEW, rank, old, new, ran=ran)
    after = _state(new)
    patch.teardown(new_groups)
    patch.teardown(old_groups)
    return {"everyone": everyone, "after": after, "ran": sorted(t.what for t in ran)}


@pytest.mark.parametrize("staged", [False, True], ids=["same-world", "staged-before-a-re-form"])
def test_a_layer_handed_to_the_next_stage_arrives_with_its_adam_moments(staged):
    out = run_ranks(_move_rank, 2, staged)
    old0, old1 = out[0]["everyone"][0], out[0]["everyone"][1]
    layer1 = [name for name in old0 if ".layers.1." in name]
    assert layer1 and not any(".layers.1." in name for name in out[0]["after"])  # rank 0 gave layer 1 away
    for name in layer1:  # rank 1 received weights, exp_avg and exp_avg_sq exactly
        assert len(out[1]["after"][name]) == len(old0[name]) == 3, name
        assert out[1]["after"][name] == old0[name], name
    for name, kept in old1.items():  # rank 1 kept layers 2-3 and the output layer as they were
        assert out[1]["after"][name] == kept, name
    moved = sorted(t.what for t in transfers(OLD, NEW) if t.crosses)
    assert moved and all(m[3] == 0 and m[4] == 1 and m[0] == ("layer", 1) for m in moved)
    assert out[0]["ran"] == out[1]["ran"] == moved  # each ran exactly the transfers that involve it
