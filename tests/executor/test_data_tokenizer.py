"""Offline tokenizers: round trips, EOD ids, GPT-2 BPE merges from user files."""

import json

import pytest

from megatron.resihp.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.resihp.data.tokenizer import _byte_to_unicode


def test_byte_level_round_trip_and_eod():
    tok = build_tokenizer("ByteLevelTokenizer")
    text = "Größe – naïve café 🙂"
    ids = tok.tokenize(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (257, 256, -1)
    assert tok.unique_identifiers["class"] == "ByteLevelTokenizer"


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("3 14 99") == [3, 14, 99]
    assert tok.detokenize([3, 14]) == "3 14"
    assert (tok.vocab_size, tok.eod) == (101, 100)
    with pytest.raises(ValueError, match="--vocab-size"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer", vocab_size=None)


def test_unknown_type_names_flag_and_choices():
    with pytest.raises(ValueError) as err:
        build_tokenizer("SentencePieceTokenizer")
    assert "--tokenizer-type" in str(err.value) and "ByteLevelTokenizer" in str(err.value)


@pytest.fixture
def bpe_files(tmp_path):
    """A tiny GPT-2-format vocabulary: all bytes, a few merges, and <|endoftext|>."""
    byte_chars = [_byte_to_unicode()[b] for b in range(256)]
    space = _byte_to_unicode()[ord(" ")]
    merges = [("t", "h"), ("th", "e"), (space, "the"), ("a", "t")]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file = tmp_path / "vocab.json"
    merge_file = tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merge_file.write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    return str(vocab_file), str(merge_file), vocab


def test_gpt2_bpe_applies_merges(bpe_files):
    vocab_file, merge_file, vocab = bpe_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    space = _byte_to_unicode()[ord(" ")]
    ids = tok.tokenize("the cat sat on the mat")
    assert ids[0] == vocab["the"]
    assert vocab[space + "the"] in ids and vocab["at"] in ids
    assert tok.detokenize(ids) == "the cat sat on the mat"
    assert tok.eod == vocab["<|endoftext|>"] and tok.vocab_size == len(vocab)
    text = "naïve 123 über\n\nnew_line"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_bpe_needs_files(tmp_path):
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=None, merge_file=None)
    vocab = tmp_path / "v.json"
    vocab.write_text(json.dumps({"a": 0}))
    merges = tmp_path / "m.txt"
    merges.write_text("")
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


def test_padded_vocab_size():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert padded_vocab_size(tok, 128, 1) == 384
    assert padded_vocab_size(tok, 128, 2) == 512
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        padded_vocab_size(tok, 0, 1)
