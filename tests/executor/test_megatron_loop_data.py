"""The Megatron loop's data iterators after a re-form (``megatron_loop_data.LoopData``): each set is
read from its own loader, rebuilt where the job stands."""

import types

import pytest

pytest.importorskip("megatron.core.rerun_state_machine", reason="megatron-core is not installed")

from megatron.resihp.megatron_loop_data import LoopData  # noqa: E402


def _loop_data(datasets, built):
    def build(dataset, consumed):  # stands in for Megatron's builder: (dataset, consumed) -> a loader
        built.append((dataset, consumed))
        return [f"{dataset}@{consumed}"]

    data = LoopData(build)
    for dataset in datasets:
        data.built(dataset)
    return data


ARGS = types.SimpleNamespace(micro_batch_size=2, consumed_valid_samples=24, data_parallel_size=2, global_batch_size=16,
                             eval_global_batch_size=16, eval_micro_batch_size=2)
EVEN = types.SimpleNamespace(quotas=(4, 4), replica=0, tp_rank=0, objects=types.SimpleNamespace(chunks=("chunk",)))


def test_before_a_re_form_every_evaluation_reads_megatrons_own_iterator():
    data = _loop_data(["train", "valid", "test"], [])
    valid, test = iter([]), iter([])
    data.loop_valid = valid
    assert data.eval_iterator(valid) is valid and data.eval_iterator(test) is test
    assert data.train_iterator is None


def test_after_a_re_form_each_set_is_read_from_its_own_rebuilt_loader():
    built = []
    data = _loop_data(["train", "valid", "test"], built)
    valid, test = iter([]), iter([])
    data.loop_valid = valid
    data.rebuild(ARGS, EVEN, consumed=96)
    # Training at the job's samples, validation at Megatron's validation count, test from its start.
    assert built == [("train", 96), ("valid", 24), ("test", 0)]
    assert next(data.train_iterator) == "train@96"
    assert next(data.eval_iterator(valid)) == "valid@24"
    assert next(data.eval_iterator(test)) == "test@0"


def test_a_rank_other_than_its_groups_tp_rank_0_builds_no_loader():
    # It may hold the datasets (opened for a later TP-1 replica), but TP rank 0 reads for its group.
    built = []
    data = _loop_data(["train", "valid", "test"], built)
    data.rebuild(ARGS, types.SimpleNamespace(quotas=(4, 4), replica=0, tp_rank=1, objects=EVEN.objects), consumed=96)
    assert built == [] and data.train_iterator is None


def test_a_quota_change_rebuilds_training_only_and_a_missing_set_stays_megatrons():
    built = []
    data = _loop_data(["train", "valid", None], built)
    valid, test = iter([]), iter([])
    data.loop_valid = valid
    data.rebuild(ARGS, EVEN, consumed=96)
    data.rebuild(ARGS, EVEN, consumed=112, train_only=True)
    assert built == [("train", 96), ("valid", 24), ("train", 112)]
    assert data.eval_iterator(test) is test  # the job has no test set: nothing was rebuilt for it


def test_under_the_interleaved_schedule_each_model_chunk_reads_its_own_rebuilt_loaders():
    # Megatron builds the three loaders once per model chunk, and hands train() a list per set.
    built = []
    data = _loop_data(["train0", "valid0", "test0", "train1", "valid1", "test1"], built)
    valid, test = [iter([]), iter([])], [iter([]), iter([])]
    data.loop_valid = valid
    two_chunks = types.SimpleNamespace(quotas=(4, 4), replica=1, tp_rank=0, objects=types.SimpleNamespace(chunks=("c0", "c1")))
    data.rebuild(ARGS, two_chunks, consumed=96)
    assert built == [("train0", 96), ("train1", 96), ("valid0", 24), ("valid1", 24), ("test0", 0), ("test1", 0)]
    assert [next(it) for it in data.train_iterator] == ["train0@96", "train1@96"]
    assert [next(it) for it in data.eval_iterator(valid)] == ["valid0@24", "valid1@24"]
    assert [next(it) for it in data.eval_iterator(test)] == ["test0@0", "test1@0"]


def test_replicas_that_do_not_split_the_evaluation_batch_evenly_each_read_their_share_of_it():
    # 3 replicas live, Megatron's arithmetic given 2 (8 micro-batches of 1): each validation loader
    # reads its quota of every evaluation batch, together every sample of it once, from Megatron's
    # validation count on; the test set likewise from its start.
    import torch

    def build(dataset, consumed):
        return torch.utils.data.DataLoader(dataset, batch_size=1)

    args = types.SimpleNamespace(micro_batch_size=1, consumed_valid_samples=24, data_parallel_size=2,
                                 global_batch_size=8, eval_global_batch_size=8, eval_micro_batch_size=1)
    read = {}
    for replica in range(3):
        data = LoopData(build)
        for dataset in (list(range(100)), list(range(1000, 1100)), list(range(2000, 2100))):
            data.built(dataset)
        valid, test = iter([]), iter([])
        data.loop_valid = valid
        run = types.SimpleNamespace(quotas=(3, 3, 2), replica=replica, tp_rank=0, objects=types.SimpleNamespace(chunks=("c",)))
        data.rebuild(args, run, consumed=48)
        quota = run.quotas[replica]
        read[replica] = {name: [int(next(it)) for _ in range(quota)]
                         for name, it in (("valid", data.eval_iterator(valid)), ("test", data.eval_iterator(test)))}
    assert sorted(v for r in read.values() for v in r["valid"]) == list(range(1024, 1032))
    assert sorted(v for r in read.values() for v in r["test"]) == list(range(2000, 2008))
