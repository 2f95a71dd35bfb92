"""Corpus -> preprocess -> indexed files, and the variable-length mock documents (``--mock-doc-lengths``)."""

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
from megatron.resihp.data.datasets import ResiHPGPTDatasetConfig, VariableLengthMockGPTDataset  # noqa: E402
from tests.dist.input_files import preprocess_tool, tokenizer_from_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(ROOT, "tools", "preprocess_data.py")


# What training builds for the byte-level files preprocess_data writes: ids as they are, EOD 256.
TOK = tokenizer_from_flags("--tokenizer-type", "NullTokenizer", "--vocab-size", "257")


def _mock_documents(spec: str, seed: int = 1234, seq_length: int = 256):
    """The training split of ``--mock-data --mock-doc-lengths spec`` as Megatron's dataset builder makes it."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    config = ResiHPGPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=None, split="90,10,0", tokenizer=TOK,
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=False,
        path_to_cache=None, mock_doc_lengths=spec,
    )
    return BlendedMegatronDatasetBuilder(VariableLengthMockGPTDataset, [40, 4, 0], lambda: True, config).build()[0]


def _preprocess(tmp_path, lines, *extra):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(lines))
    prefix = tmp_path / "out" / "corpus"
    argv = ["--input", str(corpus), "--json-keys", "text", "--output-prefix", str(prefix),
            "--tokenizer-type", "ByteLevelTokenizer", *extra]
    return preprocess_tool().main(argv), f"{prefix}_text_document"


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
    assert first[-1] == TOK.eod and bytes(first[:-1]).decode("utf-8") == docs[0]


def test_variable_length_mock_documents_follow_the_spec():
    spec = "lognormal:median=24,sigma=1.0,min=4,max=200"
    train = _mock_documents(spec)
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
    again, other = _mock_documents(spec), _mock_documents(spec, seed=7)
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
