"""Megatron-LM's ``torch_dist`` saves in a world whose replicas run at different TP degrees.

Responsible for what each rank hands Megatron's checkpoint save after a fail-stop plan left a
replica at a smaller TP degree than others (``megatron_loop_stages.tp_shrink_refused``).
megatron-core's save requires every rank's shard of one tensor to have one shape, and the
replicas at the largest degree hold every shard (they lead in DP order:
``resihp_ext.planner.survivors.plan_survivors(tp_descending=True)``, so their ranks are data-parallel
rank 0 and write). A rank of a replica at a smaller degree therefore hands over none of the state its replica shares
with the others (the sharded tensors and objects of the model, the optimizer and the RNG), only
the rest: the common part, alike on every rank, and what each rank saves of its own (the rerun
state machine's, addressed by global rank); the checkpoint is the one a run at the largest degree
saves. In a world at one degree every rank saves as stock Megatron-LM does, and a
``torch_dist`` checkpoint saved at a smaller degree than the launch's loads at the launch's
(megatron-core reshards on load).
"""

from __future__ import annotations

_ORIGINAL: dict[str, object] = {}


def install() -> None:
    from megatron.training import checkpointing

    if _ORIGINAL:
        return
    _ORIGINAL["generate_state_dict"] = original = checkpointing.generate_state_dict

    def generate_state_dict(args, *rest, **kwargs):
        state = original(args, *rest, **kwargs)
        if args.ckpt_format != "torch_dist" or not below_largest_degree():
            return state
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        _, common = extract_sharded_base({key: value for key, value in state.items() if replicated(key)})
        return {**{key: value for key, value in state.items() if not replicated(key)}, **common}

    checkpointing.generate_state_dict = generate_state_dict


def uninstall() -> None:
    from megatron.training import checkpointing

    if _ORIGINAL:
        checkpointing.generate_state_dict = _ORIGINAL.pop("generate_state_dict")


def below_largest_degree() -> bool:
    """Whether this rank's replica runs at a smaller TP degree than another of the installed layout."""
    import torch.distributed as dist

    from megatron.resihp.parallel_state_patch import installed

    groups = installed()
    if groups is None:
        return False
    layout = groups.layout
    degrees = [replica.stages[0].tp_degree for replica in layout.replicas]
    replica, _ = layout.stage_of(dist.get_rank())
    return degrees[replica] < max(degrees)


def replicated(key: str) -> bool:
    """Whether the state dict entry ``key`` is state that replicas share: the model chunks
    (``model``, ``model0``, ...), the optimizer's and the RNG's."""
    return key.startswith("model") or key in ("optimizer", "rng_state")
