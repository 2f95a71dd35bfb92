"""Tokenizers selected by ``--tokenizer-type``, all working offline.

Responsible for turning text into token ids and back with the interface megatron-core's datasets
read (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``, ``tokenize``, ``detokenize``).
It must never download anything: every tokenizer here is either file-free or reads the vocabulary
files the user names.

Offered types:

- ``NullTokenizer``: text is whitespace-separated integer ids; ``--vocab-size V`` gives ids
  ``0..V-1`` and EOD ``V`` (so ``vocab_size == V + 1``), as Megatron-LM does.
- ``ByteLevelTokenizer``: UTF-8 bytes are ids ``0..255``, EOD is ``256``; needs no file.
- ``GPT2BPETokenizer``: byte-level BPE read from ``--vocab-file`` (JSON token -> id) and
  ``--merge-file`` (one merge per line), the format GPT-2 ships.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from functools import lru_cache
from typing import Iterable

import numpy as np

try:  # ``regex`` knows Unicode classes (\p{L}); ``re`` needs a close approximation.
    import regex as _re

    _PRETOKENIZE = _re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
except ImportError:  # pragma: no cover - exercised only where regex is missing
    import re as _re

    _PRETOKENIZE = _re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
    )

TOKENIZER_TYPES = ("NullTokenizer", "ByteLevelTokenizer", "GPT2BPETokenizer")


class Tokenizer:
    """Common interface; megatron-core datasets only read the attributes defined here."""

    def tokenize(self, text: str) -> list[int]:
        """Convert text to token ids."""
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        """Convert token ids back to text."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids (the embedding table needs at least this many rows)."""
        raise NotImplementedError

    @property
    def eod(self) -> int:
        """Id of the end-of-document token."""
        raise NotImplementedError

    @property
    def eos(self) -> int:
        """Same as ``eod``: these tokenizers have one document separator."""
        return self.eod

    @property
    def pad(self) -> int:
        # -1 can never be a real id, so megatron's padding logic never masks real tokens.
        return -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What makes two tokenizers interchangeable; part of megatron's dataset cache key."""
        return OrderedDict({"class": type(self).__name__})


class NullTokenizer(Tokenizer):
    """Ids written as text ("12 7 40"); for synthetic data and benchmarks.

    Args:
        vocab_size: Number of ordinary ids; EOD gets the id ``vocab_size``.
    """

    def __init__(self, vocab_size: int) -> None:
        self._num_ids = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self._num_ids]
        if bad:
            raise ValueError(
                f"NullTokenizer: ids {bad[:5]} outside [0, {self._num_ids}); raise --vocab-size"
            )
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._num_ids + 1

    @property
    def eod(self) -> int:
        return self._num_ids

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": type(self).__name__, "vocab_size": self._num_ids})


class ByteLevelTokenizer(Tokenizer):
    """One id per UTF-8 byte (0..255) plus EOD (256): needs no vocabulary file."""

    EOD = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        # A sample may cut a multi-byte character in half; show a replacement mark, not an error.
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self.EOD


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters.

    Printable Latin-1 bytes map to themselves; the rest are moved to code points from 256 up, so
    every byte has a visible, whitespace-free stand-in that a text vocabulary can store.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE from GPT-2 format files.

    Args:
        vocab_file: JSON object mapping token strings (in the byte-to-unicode alphabet) to ids;
            must contain ``<|endoftext|>``.
        merge_file: Merge rules, one ``left right`` pair per line, highest priority first; a
            first line starting with ``#version`` is skipped.
    """

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"GPT2BPETokenizer needs {flag} pointing to a file; got {path!r}")
        with open(vocab_file, encoding="utf-8") as f:
            self._encoder: dict[str, int] = json.load(f)
        if self.EOD_TOKEN not in self._encoder:
            raise ValueError(f"--vocab-file {vocab_file} has no {self.EOD_TOKEN} entry")
        self._decoder = {i: t for t, i in self._encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        self._ranks: dict[tuple[str, str], int] = {}
        for line in lines:
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"--merge-file {merge_file}: bad merge line {line!r}")
            self._ranks.setdefault((parts[0], parts[1]), len(self._ranks))
        self._byte_enc = _byte_to_unicode()
        self._byte_dec = {c: b for b, c in self._byte_enc.items()}
        self._cache: dict[str, list[str]] = {}
        self._paths = (os.path.abspath(vocab_file), os.path.abspath(merge_file))

    def _bpe(self, word: str) -> list[str]:
        """Apply merges to one pre-token (already in the byte alphabet), lowest rank first."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            ranked = [
                (self._ranks.get((a, b), len(self._ranks)), i)
                for i, (a, b) in enumerate(zip(parts, parts[1:]))
            ]
            rank, _ = min(ranked)
            if rank == len(self._ranks):
                break
            pair = next((parts[i], parts[i + 1]) for r, i in ranked if r == rank)
            merged: list[str] = []
            i = 0
            # Merge every occurrence of the best pair, left to right, as GPT-2 does.
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self._cache) < 100_000:
            self._cache[word] = parts
        return parts

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for pre in _PRETOKENIZE.findall(text):
            mapped = "".join(self._byte_enc[b] for b in pre.encode("utf-8"))
            for piece in self._bpe(mapped):
                try:
                    ids.append(self._encoder[piece])
                except KeyError:
                    raise ValueError(
                        f"--vocab-file lacks token {piece!r} produced by --merge-file; the two "
                        "files do not belong together"
                    ) from None
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text = "".join(self._decoder[int(i)] for i in ids)
        data = bytes(self._byte_dec[c] for c in text if c in self._byte_dec)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def eod(self) -> int:
        return self._encoder[self.EOD_TOKEN]

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            {"class": type(self).__name__, "vocab_file": self._paths[0], "merge_file": self._paths[1]}
        )


def build_tokenizer(
    tokenizer_type: str,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Tokenizer:
    """Build the tokenizer named by ``--tokenizer-type``.

    Args:
        tokenizer_type: One of :data:`TOKENIZER_TYPES`.
        vocab_size: ``--vocab-size``; required by ``NullTokenizer``, ignored otherwise.
        vocab_file: ``--vocab-file``; required by ``GPT2BPETokenizer``.
        merge_file: ``--merge-file``; required by ``GPT2BPETokenizer``.

    Returns:
        The tokenizer.

    Raises:
        ValueError: Unknown type or a missing/invalid file or size, naming the flag.
    """
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}"
            )
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)  # type: ignore[arg-type]
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not offered; choose one of "
        f"{', '.join(TOKENIZER_TYPES)}"
    )


def padded_vocab_size(tokenizer: Tokenizer, multiple: int, tensor_parallel_degree: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up so every TP shard gets an equal slice.

    Args:
        tokenizer: The tokenizer.
        multiple: ``--make-vocab-size-divisible-by`` (Megatron's default is 128).
        tensor_parallel_degree: ``--tensor-model-parallel-size``.

    Returns:
        The padded vocabulary size.
    """
    if multiple < 1 or tensor_parallel_degree < 1:
        raise ValueError(
            "--make-vocab-size-divisible-by and --tensor-model-parallel-size must be >= 1"
        )
    step = multiple * tensor_parallel_degree
    return int(np.ceil(tokenizer.vocab_size / step) * step)
