"""Corpus -> preprocess -> megatron datasets, and the variable-length mock workload."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from megatron.resihp.data.batch import document_lengths  # noqa: E402
from megatron.resihp.data.datasets import build_pretraining_datasets  # noqa: E402
from megatron.resihp.data.tokenizer import build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(ROOT, "tools", "preprocess_data.py")
TOK = build_tokenizer("ByteLevelTokenizer")


def _common(**kw):
    args = dict(
        data_path=None, split="90,10,0", mock_data=False, seq_length=64, seed=1234, tokenizer=TOK,
        num_samples=(40, 4, 0), reset_position_ids=True, reset_attention_mask=True,
        eod_mask_loss=True, create_attention_mask=False, path_to_cache=None,
    )
    args.update(kw)
    return args


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # so worker processes can unpickle its functions
    spec.loader.exec_module(module)
    return module


def _preprocess(tmp_path, lines, *extra):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(lines))
    prefix = tmp_path / "out" / "corpus"
    argv = ["--input", str(corpus), "--json-keys", "text", "--output-prefix", str(prefix),
            "--tokenizer-type", "ByteLevelTokenizer", *extra]
    return _load_tool().main(argv), f"{prefix}_text_document"


@pytest.fixture(scope="module")
def real_prefix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    docs = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(60)]
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = tmp / "out" / "corpus"
    # A real command line with worker processes (in-process pools would re-import pytest).
    proc = subprocess.run(
        [sys.executable, PREPROCESS, "--input", str(corpus), "--output-prefix", str(prefix),
         "--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--workers", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    prefix = f"{prefix}_text_document"
    return prefix, docs


def test_preprocess_writes_documents_with_eod(real_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, docs = real_prefix
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    first = ds[0].tolist()
    assert first[-1] == TOK.eod and TOK.detokenize(first[:-1]) == docs[0]


def test_real_data_sample(real_prefix, tmp_path):
    prefix, _ = real_prefix
    train, valid, test = build_pretraining_datasets(
        **_common(data_path=[prefix], path_to_cache=str(tmp_path / "cache"), create_attention_mask=True)
    )
    assert test is None and len(train) >= 40 and len(valid) >= 4
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "attention_mask", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (64,) and sample["attention_mask"].shape == (1, 64, 64)
    assert torch.equal(sample["loss_mask"] == 0, sample["tokens"] == TOK.eod)
    assert "quick brown fox" in TOK.detokenize(torch.cat([train[i]["tokens"] for i in range(3)]).tolist())


def test_weighted_blend(real_prefix, tmp_path):
    prefix, _ = real_prefix
    train, _, _ = build_pretraining_datasets(
        **_common(data_path=[f"0.3 {prefix} 0.7 {prefix}"], path_to_cache=str(tmp_path))
    )
    assert len(train) == 40


def test_flag_errors(tmp_path):
    with pytest.raises(ValueError, match="--data-path"):
        build_pretraining_datasets(**_common(data_path=[str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match="--mock-data"):
        build_pretraining_datasets(**_common(mock_doc_lengths="fixed:length=8"))
    with pytest.raises(ValueError, match="--mock-doc-lengths"):
        build_pretraining_datasets(**_common(mock_data=True, mock_doc_lengths="gamma:k=1"))
    with pytest.raises(ValueError, match="--data-path"):
        build_pretraining_datasets(**_common())


def test_variable_length_mock_documents_follow_the_spec():
    spec = "lognormal:median=24,sigma=1.0,min=4,max=200"
    train, _, _ = build_pretraining_datasets(
        **_common(mock_data=True, seq_length=256, mock_doc_lengths=spec)
    )
    lengths = []
    for i in range(40):
        sample = train[i]
        tokens = sample["tokens"]
        assert torch.equal(sample["loss_mask"] == 0, tokens == TOK.eod)
        # reset_position_ids restarts after each EOD.
        after_eod = (tokens[:-1] == TOK.eod).nonzero().flatten() + 1
        assert (sample["position_ids"][after_eod] == 0).all()
        # Interior segments are whole documents (the first and last may be cut).
        lengths += document_lengths(tokens, TOK.eod)[0][1:-1]
    lengths = np.array(lengths)
    assert lengths.min() >= 4 and lengths.max() <= 200
    assert 16 <= np.median(lengths) <= 34
    # Different seeds give different workloads; the same seed the same.
    again, _, _ = build_pretraining_datasets(**_common(mock_data=True, seq_length=256, mock_doc_lengths=spec))
    other, _, _ = build_pretraining_datasets(
        **_common(mock_data=True, seq_length=256, mock_doc_lengths=spec, seed=7)
    )
    assert torch.equal(again[5]["tokens"], train[5]["tokens"])
    assert not torch.equal(other[5]["tokens"], train[5]["tokens"])


def test_preprocess_bad_input_exits_2_and_leaves_nothing(tmp_path, capsys):
    rc, _ = _preprocess(tmp_path, ['{"text": "fine"}\n', "not json\n"])
    assert rc == 2 and "line 2" in capsys.readouterr().err
    rc, _ = _preprocess(tmp_path, ['{"body": "x"}\n'])
    assert rc == 2 and "'text'" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == []



def test_an_index_and_data_file_that_disagree_are_named(real_prefix, tmp_path):
    from megatron.resihp.data.indexed_files import check_indexed_dataset

    prefix, _ = real_prefix
    check_indexed_dataset(prefix)
    for suffix, cut, message in ((".bin", 1, "do not belong together or one is truncated"),
                                 (".idx", 8, "is truncated or corrupt"),
                                 (".idx", 10**9, "not a Megatron index")):
        copy = tmp_path / suffix[1:] / "copy"
        copy.parent.mkdir(exist_ok=True)
        for s in (".idx", ".bin"):
            shutil.copy(prefix + s, f"{copy}{s}")
        path = f"{copy}{suffix}"
        os.truncate(path, max(0, os.path.getsize(path) - cut))
        with pytest.raises(ValueError, match=rf"--data-path: .*copy\{suffix}.*{message}"):
            check_indexed_dataset(str(copy))


def test_the_resilient_front_end_refuses_a_split_without_a_document(real_prefix, capsys):
    from megatron.resihp.arguments import parse_args

    prefix, docs = real_prefix
    argv = ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2"]
    assert parse_args([*argv, "--split", "98,2,0"], world_size=1).split == "98,2,0"
    with pytest.raises(SystemExit) as stop:
        parse_args(argv, world_size=1)  # the default split, 969,30,1, gives 60 documents' test split none
    assert stop.value.code == 2
    assert f"the test split gets none of the {len(docs)} documents" in capsys.readouterr().err
