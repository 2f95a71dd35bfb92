"""The distributed optimizer's parts in model space: read from one optimizer, split as several
owners would hold them, and written into another, they give the same state and the same next step.

One process (a one-rank gloo world, Megatron-LM's CPU mode): megatron-core's ``DistributedDataParallel``
and ``DistributedOptimizer`` (behind its ``ChainedOptimizer``), torch Adam.
"""

from __future__ import annotations

import pytest
import torch

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="the CPU mode of Megatron-LM's loop patches megatron-core 0.19.2")


@pytest.fixture
def world():
    from megatron.resihp import cpu_training
    from tests.one_rank_world import one_rank_world

    cpu_training.enable()
    try:
        with one_rank_world("gloo"):
            yield
    finally:
        cpu_training.disable()


def build(seed: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    Tiny(config))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True),
                                       [model])
    return model, optimizer


def train(model, optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(torch.randn(3, 8)).sum().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]


def split(part, owners: int):
    """``part`` as ``owners`` ranks would hold it: each piece cut into consecutive ranges, the
    owners' pieces in reverse order (a receiver must not rely on one owner's order)."""
    from megatron.resihp.optimizer_parts import KEYS, Part

    pieces, values = [[] for _ in range(owners)], [[] for _ in range(owners)]
    offset = 0
    for chunk, param, start, end in part.pieces.tolist():
        size = end - start
        block = part.values[offset:offset + len(KEYS) * size].view(len(KEYS), size)
        offset += len(KEYS) * size
        cuts = torch.linspace(start, end, owners + 1).round().long().tolist()
        for owner, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            if lo < hi:
                pieces[owner].insert(0, (chunk, param, lo, hi))
                values[owner].insert(0, block[:, lo - start:hi - start].reshape(-1))
    return [Part(torch.tensor(p, dtype=torch.int64).reshape(-1, 4), torch.cat(v), part.updates)
            for p, v in zip(pieces, values)]


def states(optimizer) -> list[torch.Tensor]:
    from megatron.resihp.optimizer_parts import KEYS, _ranges, _states

    return [_states(sub, p)[k].detach().clone() for sub, p, _ in _ranges(optimizer) for k in KEYS]


def test_parts_split_over_owners_rebuild_the_state_and_the_next_step_exactly(world):
    from megatron.resihp.optimizer_parts import read_part, regather, write_parts

    model, optimizer = build(0)
    for step in range(2):
        train(model, optimizer, 10 + step)
    parts = split(read_part(optimizer, updates=2), owners=3)
    assert sum(p.pieces.shape[0] for p in parts) > read_part(optimizer, 2).pieces.shape[0]  # really cut

    other_model, other = build(1)  # other initial weights: everything must come from the parts
    other.load_state_dict(optimizer.state_dict())
    write_parts(other, parts)
    regather(other)
    for mine, theirs in zip(states(optimizer), states(other)):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    for mine, theirs in zip(model.parameters(), other_model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    train(model, optimizer, 99)
    train(other_model, other, 99)
    for mine, theirs in zip(model.parameters(), other_model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)


def test_parts_that_miss_elements_are_refused(world):
    from megatron.resihp.optimizer_parts import read_part, write_parts

    model, optimizer = build(0)
    train(model, optimizer, 10)
    parts = split(read_part(optimizer, updates=1), owners=2)
    _, other = build(1)
    other.load_state_dict(optimizer.state_dict())
    with pytest.raises(RuntimeError, match="cover"):
        write_parts(other, parts[:1])


def test_a_part_read_before_adams_first_step_is_its_parameters_with_zero_moments_and_leaves_no_state(world):
    from megatron.resihp.optimizer_parts import KEYS, read_part

    model, optimizer = build(0)
    part = read_part(optimizer, updates=0)
    values = part.values.view(-1)
    offset = 0
    for _, _, start, end in part.pieces.tolist():
        size = end - start
        block = values[offset:offset + len(KEYS) * size].view(len(KEYS), size)
        assert not block[1:].any()  # no moments yet
        offset += len(KEYS) * size
    assert all(not optimizer_state for sub in optimizer.chained_optimizers for optimizer_state in [sub.optimizer.state])
    assert optimizer.state_dict()["optimizer"]["param_groups"][0]["step"] == 0  # still reads as not stepped


def test_whole_states_from_split_parts_give_back_the_state_and_the_next_step_exactly(world):
    # What a re-plan that moves layers does with the distributed optimizer: the position's parts
    # become each parameter's whole state, and a rebuilt optimizer takes its part from them.
    from megatron.resihp.optimizer_parts import KEYS, is_distributed, read_part, whole_part, whole_states, write_parts

    model, optimizer = build(0)
    assert is_distributed(optimizer)
    for step in range(2):
        train(model, optimizer, 10 + step)
    whole = whole_states(optimizer, split(read_part(optimizer, updates=2), owners=3))
    for param, state in whole.items():
        assert state.shape == (len(KEYS), param.numel())
        torch.testing.assert_close(state[0].view_as(param), param.detach().float(), rtol=0, atol=0)  # fp32: main == model
    other_model, other = build(1)
    other.load_state_dict(optimizer.state_dict())
    moved = whole_states(other)  # zeros, filled as a move would fill them
    for mine, theirs in zip(model.parameters(), other_model.parameters()):
        moved[theirs].copy_(whole[mine])
        theirs.data.copy_(mine.data)
    write_parts(other, [whole_part(other, moved, updates=2)])
    for mine, theirs in zip(states(optimizer), states(other)):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    train(model, optimizer, 99)
    train(other_model, other, 99)
    for mine, theirs in zip(model.parameters(), other_model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="cover"):
        whole_states(optimizer, split(read_part(optimizer, updates=2), owners=2)[:1])
