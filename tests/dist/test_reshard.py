"""A rank rebuilt into a stage receives that stage's state from the surviving replica (real gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from resihp_ext.layout import Layout
from tests.dist.ranks import TINY, run_ranks


def _reshard_rank(rank, world_size, store):
    from megatron.resihp import parallel_state_patch as patch
    from megatron.resihp.reshard import copy_stage_state_from_replica

    # TP1 x PP1 x DP3: rank 0 survived, ranks 1 and 2 were rebuilt with fresh weights.
    groups = patch.build_groups(Layout.uniform(TINY, 1, 1, 3), rank, timeout=30)
    torch.manual_seed(100 + rank)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    module.register_buffer("steps", torch.tensor([rank], dtype=torch.int64))
    states = [{"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)} for p in module.parameters()]
    num_bytes = copy_stage_state_from_replica(module, src=0, group=groups.dp_group, optimizer_states=states)
    flat = torch.cat([t.double().reshape(-1) for t in module.state_dict().values()]
                     + [s[k].double().reshape(-1) for s in states for k in sorted(s)])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, flat.tolist())
    patch.teardown(groups)
    return {"gathered": gathered, "bytes": num_bytes}


def test_rebuilt_ranks_receive_the_surviving_replicas_state():
    out = run_ranks(_reshard_rank, 3)
    gathered = out[0]["gathered"]
    assert gathered[0] == gathered[1] == gathered[2]
    assert len(gathered[0]) == (8 * 4 + 4 + 4 + 4 + 1) + 2 * (8 * 4 + 4 + 4 + 4)
    assert out[1]["bytes"] == out[0]["bytes"] > 0
