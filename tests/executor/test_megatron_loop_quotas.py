"""Unequal micro-batch quotas on Megatron-LM's loop: who trains which samples, how losses are weighed."""

import itertools

import pytest
import torch

from megatron.resihp.data_samplers import QuotaPretrainingSampler, megatron_order_slots
from megatron.resihp.megatron_loop_quotas import loss_factor, quota_loader, scaled_loss, uneven, with_microbatches

MBS = 2


def batches(sampler, count):
    return list(itertools.islice(iter(sampler), count))


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_equal_quotas_give_each_replica_what_megatrons_own_sampler_gives_it(replicas):
    data_samplers = pytest.importorskip("megatron.training.datasets.data_samplers",
                                        reason="Megatron-LM's training package ships in megatron-core 0.19")
    quotas = [3] * replicas
    for replica in range(replicas):
        ours = QuotaPretrainingSampler(1000, 40, MBS, quotas, replica)
        stock = data_samplers.MegatronPretrainingSampler(1000, 40, MBS, replica, replicas)
        assert batches(ours, 12) == batches(stock, 12)


@pytest.mark.parametrize("quotas", [(5, 3), (2, 6), (1, 3, 2, 2), (7, 1)])
def test_unequal_quotas_train_every_sample_of_each_global_batch_once(quotas):
    gbs = MBS * sum(quotas)
    per_replica = [batches(QuotaPretrainingSampler(10_000, 24, MBS, quotas, r), 3 * q) for r, q in enumerate(quotas)]
    for step in range(3):
        taken = [i for r, q in enumerate(quotas) for mb in per_replica[r][step * q:(step + 1) * q] for i in mb]
        assert sorted(taken) == list(range(24 + step * gbs, 24 + (step + 1) * gbs))
    assert sorted(s for r, q in enumerate(quotas) for s in megatron_order_slots(quotas, r)) == list(range(sum(quotas)))


def test_the_sampler_stops_before_a_global_batch_it_cannot_fill():
    assert len(list(QuotaPretrainingSampler(30, 0, MBS, (2, 1), 0))) == 2 * (30 // 6)


def test_the_loss_factor_makes_the_replicas_average_the_global_batchs_mean():
    # Megatron divides each replica's summed micro-batch losses by its own count and averages the
    # replicas' gradients; with the factor that is the mean over every micro-batch.
    quotas = (5, 2, 1)
    values = torch.arange(8, dtype=torch.float64) ** 2  # one gradient value per micro-batch
    start = [0, 5, 7]
    average = sum(loss_factor(quotas, r, False) * values[start[r]:start[r] + q].sum() / q
                  for r, q in enumerate(quotas)) / len(quotas)
    assert average.item() == pytest.approx(values.mean().item(), rel=1e-12)
    assert loss_factor(quotas, 0, True) == 1.0  # per-token loss: Megatron divides by the global count
    assert loss_factor((4, 4), 1, False) == 1.0 and not uneven((4, 4)) and uneven((5, 3))


def test_the_scaled_loss_multiplies_the_optimizers_scaling_and_is_the_scaling_itself_at_one():
    def scale(loss):
        return loss * 8.0

    assert scaled_loss(scale, 1.0) is scale
    assert scaled_loss(scale, 0.5)(torch.tensor(3.0)).item() == 12.0


def test_the_forward_backward_runs_this_replicas_count_whatever_it_is_asked():
    seen = []

    def forward_backward(**kwargs):
        seen.append(kwargs["num_microbatches"])
        return kwargs["model"]

    assert with_microbatches(forward_backward, 3)(model="m", num_microbatches=4) == "m" and seen == [3]


def test_the_quota_loader_keeps_megatrons_loader_settings_and_yields_this_replicas_share():
    dataset = [{"tokens": torch.tensor([i])} for i in range(64)]
    built = []

    def build(ds, consumed):  # stands in for Megatron's builder: same signature, a real DataLoader
        built.append(consumed)
        return torch.utils.data.DataLoader(ds, batch_sampler=[[0]], num_workers=0)

    loader = quota_loader(build, dataset, 8, MBS, (3, 1), 1)
    first = next(iter(loader))
    assert built == [8] and first["tokens"].view(-1).tolist() == [10, 11]  # slot 1 of the batch at 8
