"""The input checks of a job on Megatron-LM's loop: the split rule against megatron-core's own builder, and
which flags and files are checked, on the flags as Megatron's parser reads them."""

from __future__ import annotations

import inspect
import json
import sys

import numpy
import pytest
import torch

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")


def _corpus(folder, num_documents, name="corpus"):
    """A real indexed dataset of ``num_documents`` documents (lengths 20..39 tokens)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(folder / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for i in range(num_documents):
        builder.add_item(torch.arange(20 + i % 20, dtype=torch.int64) % 200 + 1)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _megatron_split_sizes(prefix, split, cache):
    """How many documents megatron-core's GPT builder puts in each split (sizes None: one epoch, never a hang)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=256)
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None), split=split,
                              path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    built = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    return [None if ds is None else len(ds.indices) for ds in built]


@pytest.mark.parametrize("num_documents", [3, 40, 61])
@pytest.mark.parametrize("split", ["969,30,1", "969, 30, 1", "98,2,0", "1,1,1", "0,1,0", "33,33,34", "100,0,0",
                                   "0.7,0.2,0.1", "949,50"])
def test_split_document_counts_are_megatron_cores(tmp_path, split, num_documents):
    from megatron.resihp.data.splits import split_document_counts

    prefix = _corpus(tmp_path, num_documents)
    assert split_document_counts(split, num_documents) == _megatron_split_sizes(prefix, split, tmp_path / "cache")


def test_a_split_without_a_document_is_refused_naming_the_counts_and_the_fix():
    from megatron.resihp.data.splits import check_split_documents

    check_split_documents("98,2,0", {"corpus": 40})
    with pytest.raises(ValueError, match=r"--split 969,30,1: the test split gets none of the 40 documents of corpus "
                                         r"\(train 39, validation 1, test 0\).*--split 969,30,0"):
        check_split_documents("969,30,1", {"other": 1000, "corpus": 40})
    with pytest.raises(ValueError, match="the train split gets none of the 3 documents.*larger share"):
        check_split_documents("1,100,100", {"corpus": 3})
    with pytest.raises(ValueError, match="--split 'a,b': give up to three non-negative shares"):
        check_split_documents("a,b", {"corpus": 3})


def test_the_default_split_is_megatrons():
    from megatron.resihp.megatron_inputs import MEGATRON_DEFAULT_SPLIT
    from megatron.training.arguments import validate_args

    assert f"'{MEGATRON_DEFAULT_SPLIT}'" in inspect.getsource(validate_args)


def _parsed(monkeypatch, *argv):
    from megatron.resihp.gpt_pretrain import add_device_args
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_resilient.py", "--micro-batch-size", "1", *argv])
    return parse_args(extra_args_provider=add_device_args)


def test_every_data_flag_is_checked(tmp_path, monkeypatch):
    from megatron.resihp.megatron_inputs import check_inputs

    good = _corpus(tmp_path, 40)
    empty = _corpus(tmp_path, 0, "empty")
    check_inputs(_parsed(monkeypatch, "--data-path", "1", good, "2", good, "--split", "98,2,0"))
    cases = [
        (["--data-path", "1", good, "2", str(tmp_path / "gone")], r"--data-path: .*gone\.idx not found"),
        (["--train-data-path", good, "--valid-data-path", str(tmp_path / "gone")], r"--valid-data-path: .*gone\.idx"),
        (["--train-data-path", good, "--test-data-path", empty], r"--test-data-path: .*empty holds no document"),
        (["--data-args-path", str(tmp_path / "list.txt"), "--split", "1,1,1"], r"--data-args-path .*cannot be read"),
        (["--per-split-data-args-path", str(tmp_path / "per_split.json")], r"--per-split-data-args-path .* no 'test'"),
    ]
    (tmp_path / "per_split.json").write_text(json.dumps({"train": good, "valid": [good]}))
    for argv, message in cases:
        with pytest.raises(ValueError, match=message):
            check_inputs(_parsed(monkeypatch, *argv))
    (tmp_path / "list.txt").write_text(f"0.5 {good} 0.5 {good}\n")
    check_inputs(_parsed(monkeypatch, "--data-args-path", str(tmp_path / "list.txt"), "--split", "98,2,0"))
    with pytest.raises(ValueError, match="needs --split"):
        check_inputs(_parsed(monkeypatch, "--data-args-path", str(tmp_path / "list.txt")))
    # --mock-data reads no file: the prefixes are not Megatron's to open.
    check_inputs(_parsed(monkeypatch, "--mock-data", "--data-path", str(tmp_path / "gone")))


def test_tokenizer_files_are_checked_for_the_tokenizer_that_reads_them(tmp_path, monkeypatch):
    from megatron.resihp.megatron_inputs import check_inputs

    gone = str(tmp_path / "vocab.json")
    with pytest.raises(ValueError, match="--vocab-file .*vocab.json not found"):
        check_inputs(_parsed(monkeypatch, "--mock-data", "--vocab-file", gone), {"tokenizer_type": "GPT2BPETokenizer"})
    with pytest.raises(ValueError, match="--tokenizer-model .*tok.model not found"):
        check_inputs(_parsed(monkeypatch, "--mock-data", "--tokenizer-type", "GPTSentencePieceTokenizer",
                             "--tokenizer-model", str(tmp_path / "tok.model")))
    check_inputs(_parsed(monkeypatch, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-file", gone))
    check_inputs(_parsed(monkeypatch, "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", "gpt2"))  # a model on the hub, not a file


def test_a_load_folder_that_does_not_exist_yet_is_a_fresh_start(tmp_path, monkeypatch):
    from megatron.resihp.megatron_inputs import check_inputs

    check_inputs(_parsed(monkeypatch, "--mock-data", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt")))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(ValueError, match="--load .*iter_0000004, which does not exist"):
        check_inputs(_parsed(monkeypatch, "--mock-data", "--load", str(tmp_path / "ckpt")))


def test_the_cache_goes_to_the_users_cache_unless_named(tmp_path, monkeypatch):
    from megatron.resihp.megatron_inputs import with_data_cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    argv = ["--data-path", "prefix"]
    assert with_data_cache_path(_parsed(monkeypatch, *argv), argv) == [
        "--data-cache-path", str(tmp_path / "xdg" / "resihp-megatron" / "data-cache"), *argv]
    argv = ["--data-path", "prefix", "--data-cache-path", "mine"]
    assert with_data_cache_path(_parsed(monkeypatch, *argv), argv) == argv
    argv = ["--mock-data"]
    assert with_data_cache_path(_parsed(monkeypatch, *argv), argv) == argv
