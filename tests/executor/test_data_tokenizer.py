"""``tools/preprocess_data.py`` tokenizes with the tokenizer training builds from the same flags:
megatron-core's, from Megatron-LM's own tokenizer flags, plus megatron-core's byte-level one."""

import json
import os

import pytest

from tests.dist.input_files import preprocess_tool as _tool
from tests.dist.input_files import tokenizer_from_flags as _tokenizer


def _written(tmp_path, texts, *flags):
    """The documents preprocess_data writes for ``texts``, as token id lists."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert _tool().main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--append-eod", *flags]) == 0
    written = IndexedDataset(str(tmp_path / "out_text_document"))
    return [written[i].tolist() for i in range(len(written))]


def test_byte_level_ids_are_the_utf8_bytes_and_its_eod_is_the_one_training_reads():
    text = "Größe – naïve café 🙂"
    tok = _tokenizer("--tokenizer-type", "ByteLevelTokenizer")
    assert tok.tokenize(text) == list(text.encode("utf-8")) and tok.eod == 256
    # Training reads the files with Megatron's NullTokenizer --vocab-size 257: ids as they are, EOD 256.
    training = _tokenizer("--tokenizer-type", "NullTokenizer", "--vocab-size", "257")
    assert (training.eod, training.vocab_size) == (tok.eod, 257)


def test_megatrons_null_tokenizer_is_built_from_its_flags(tmp_path):
    assert _written(tmp_path, ["3 14 99"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100") == [[3, 14, 99, 99]]


def test_a_hugging_face_tokenizer_in_a_local_folder_is_read_offline(tmp_path):
    """``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` (as Megatron-LM's Llama scripts
    pass it) with a folder made here: no download."""
    from tests.dist.input_files import hugging_face_tokenizer

    corpus = ["the cat sat on the mat", "naïve café über alles"]
    folder = tmp_path / "tokenizer"
    bpe = hugging_face_tokenizer(folder, corpus)
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    tok = _tokenizer(*flags)
    written = _written(tmp_path, corpus, *flags)
    assert written == [bpe.encode(t).ids + [tok.eod] for t in corpus]
    assert [tok.detokenize(ids[:-1]) for ids in written] == corpus and tok.eod == bpe.token_to_id("<|endoftext|>")


def test_a_tokenizer_megatron_cannot_build_exits_2_naming_the_flag(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "x"}\n')
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "no-such-folder")]
    os.environ["HF_HUB_OFFLINE"] = "1"  # a missing folder is a hub name to transformers: never ask the hub
    try:
        assert _tool().main(argv) == 2
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    err = capsys.readouterr().err
    assert "--tokenizer-type HuggingFaceTokenizer" in err and "--tokenizer-model" in err
    assert not list(tmp_path.glob("out*"))


def test_an_unknown_tokenizer_type_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        _tokenizer("--tokenizer-type", "NoSuchTokenizer")
    assert exit_.value.code == 2 and "ByteLevelTokenizer" in capsys.readouterr().err
