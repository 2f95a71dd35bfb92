"""Tokenize a JSONL corpus into megatron-core's indexed dataset format (``.bin`` + ``.idx``).

Responsible for the offline step between raw text and training: read one JSON object per line,
tokenize the chosen keys with the tokenizer training will use, and write
``PREFIX_<key>_document.bin/.idx`` through megatron-core's ``IndexedDatasetBuilder``. Output is
written under temporary names and renamed only when complete, so a failed run leaves nothing
that training could mistake for a dataset.

Usage (same flags as Megatron-LM's ``tools/preprocess_data.py``)::

    python tools/preprocess_data.py --input data/generated/corpus.jsonl --json-keys text \\
        --output-prefix data/generated/corpus --tokenizer-type ByteLevelTokenizer \\
        --append-eod --workers 2

Exit status: 0 on success, 2 on bad input (missing file, bad JSON, missing key, bad tokenizer
flags), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

# Allow ``python tools/preprocess_data.py`` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.resihp.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


class InputError(Exception):
    """Bad user input: reported on stderr with exit status 2."""


_TOKENIZER = None
_ARGS = None


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER, _ARGS
    _ARGS = args
    _TOKENIZER = build_tokenizer(args.tokenizer_type, args.vocab_size, args.vocab_file, args.merge_file)


def _encode(numbered_line: tuple[int, str]) -> tuple[int, dict[str, list[int]] | str]:
    """Tokenize one JSONL line; returns (line number, ids per key) or (line number, error)."""
    lineno, line = numbered_line
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return lineno, f"line {lineno} of --input is not valid JSON ({err.msg})"
    if not isinstance(record, dict):
        return lineno, f"line {lineno} of --input is not a JSON object"
    out: dict[str, list[int]] = {}
    for key in _ARGS.json_keys:
        if key not in record:
            return lineno, f"line {lineno} of --input has no key {key!r} (see --json-keys)"
        if not isinstance(record[key], str):
            return lineno, f"line {lineno} of --input: {key!r} is not a string"
        try:
            ids = _TOKENIZER.tokenize(record[key])
        except ValueError as err:
            return lineno, f"line {lineno} of --input: {err}"
        if ids and _ARGS.append_eod:
            ids = list(ids) + [_TOKENIZER.eod]
        out[key] = ids
    return lineno, out


def _lines(path: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def preprocess(args: argparse.Namespace) -> dict[str, int]:
    """Run the conversion.

    Args:
        args: Parsed command line.

    Returns:
        Number of documents written per key.

    Raises:
        InputError: On bad input; no output file is left behind.
    """
    # Imported here, not at module level: spawned tokenizer workers re-import this module and
    # need neither torch nor megatron-core (whose import is slow and warns about TE/apex).
    import warnings

    import torch

    with warnings.catch_warnings():
        # megatron-core announces missing Transformer Engine/apex on import; irrelevant here.
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input!r} is not a file")
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.vocab_file, args.merge_file)
    except ValueError as err:
        raise InputError(str(err)) from None
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    final = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    temp = {k: f"{final[k]}.tmp{os.getpid()}" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(temp[k] + ".bin", dtype=dtype) for k in args.json_keys}
    counts = {k: 0 for k in args.json_keys}
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (args,))
            results = pool.imap(_encode, _lines(args.input), chunksize=32)
        else:
            _init_worker(args)
            results = map(_encode, _lines(args.input))
        for _, encoded in results:
            if isinstance(encoded, str):
                raise InputError(encoded)
            for key, ids in encoded.items():
                # Empty documents carry no tokens and would only add zero-length index entries.
                if not ids:
                    continue
                builders[key].add_item(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
                builders[key].end_document()
                counts[key] += 1
        for key in args.json_keys:
            if counts[key] == 0:
                raise InputError(f"--input has no non-empty {key!r} text; nothing to write")
            builders[key].finalize(temp[key] + ".idx")
        for key in args.json_keys:
            # .idx last: a reader that finds the index also finds complete data.
            os.replace(temp[key] + ".bin", final[key] + ".bin")
            os.replace(temp[key] + ".idx", final[key] + ".idx")
    finally:
        if pool is not None:
            pool.terminate()
        for key in args.json_keys:
            builders[key].data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(temp[key] + suffix):
                    os.remove(temp[key] + suffix)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Tokenize JSONL into megatron .bin/.idx files.")
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSONL file, one object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--vocab-file", default=None, help="for GPT2BPETokenizer")
    group.add_argument("--merge-file", default=None, help="for GPT2BPETokenizer")
    group.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"preprocess_data: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    if len(set(args.json_keys)) != len(args.json_keys):
        print(f"preprocess_data: --json-keys repeats a key: {args.json_keys}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        counts = preprocess(args)
    except InputError as err:
        print(f"preprocess_data: {err}", file=sys.stderr)
        return 2
    elapsed_s = time.perf_counter() - start
    for key, count in counts.items():
        print(
            f"preprocess_data: {count} documents -> {args.output_prefix}_{key}_document.bin/.idx "
            f"({elapsed_s:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
