"""Tokenize a JSONL corpus into megatron-core's indexed dataset format (``.bin`` + ``.idx``).

Responsible for the offline step between raw text and training: read one JSON object per line,
tokenize the chosen keys with the tokenizer training will use, and write
``PREFIX_<key>_document.bin/.idx`` through megatron-core's ``IndexedDatasetBuilder``. Output is
written under temporary names and renamed only when complete, so a failed run leaves nothing
that training could mistake for a dataset.

The tokenizer is the one training builds: Megatron-LM's tokenizer flags (``--tokenizer-type``,
``--tokenizer-model``, ``--vocab-file``, ``--merge-file``, ``--vocab-size``, ...) parsed by its own
argument group and built by megatron-core's ``build_tokenizer``. One more type needs no file and no
download: ``ByteLevelTokenizer``, megatron-core's byte-level tokenizer with ids 0..255 and EOD 256,
which training reads with ``--tokenizer-type NullTokenizer --vocab-size 257`` (whose EOD is 256).

Usage (the flags of Megatron-LM's ``tools/preprocess_data.py``)::

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

BYTE_LEVEL = "ByteLevelTokenizer"
BYTE_LEVEL_EOD = 256


class InputError(Exception):
    """Bad user input: reported on stderr with exit status 2."""


_TOKENIZER = None
_ARGS = None


def build_tokenizer(args: argparse.Namespace):
    """The tokenizer training builds from the same flags (``ByteLevelTokenizer``: megatron-core's
    byte-level one, EOD 256).

    Raises:
        InputError: the flags name no tokenizer that can be built here, with megatron-core's reason.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # megatron-core's notes on missing TE/apex
        from megatron.core.tokenizers import MegatronTokenizer
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build_megatrons

    if args.tokenizer_type == BYTE_LEVEL:
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, vocab_size=BYTE_LEVEL_EOD + 1,
                                                 _eos_id=BYTE_LEVEL_EOD, _pad_id=BYTE_LEVEL_EOD)
    args.pad_vocab_size = False  # the ids are the tokenizer's; padding is the model's business
    try:
        return build_megatrons(args)
    except (ValueError, AssertionError, OSError, ImportError, NameError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(f"--tokenizer-type {args.tokenizer_type}: megatron-core could not build it ({first}); "
                         f"check --tokenizer-model, --vocab-file, --merge-file and --vocab-size") from None


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER, _ARGS
    _ARGS = args
    _TOKENIZER = build_tokenizer(args)


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
    # need only megatron-core's tokenizers, not its datasets.
    import warnings

    import torch

    with warnings.catch_warnings():
        # megatron-core announces missing Transformer Engine/apex on import; irrelevant here.
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input!r} is not a file")
    tokenizer = build_tokenizer(args)
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
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.training.arguments import _add_tokenizer_args

    parser = argparse.ArgumentParser(description="Tokenize JSONL into megatron .bin/.idx files.")
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSONL file, one object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize")
    _add_tokenizer_args(parser)  # Megatron-LM's tokenizer flags, as training parses them
    (kind,) = [a for a in parser._actions if "--tokenizer-type" in a.option_strings]
    kind.required = True
    kind.choices = [*kind.choices, BYTE_LEVEL]
    kind.help = f"{kind.help} {BYTE_LEVEL}: UTF-8 bytes 0..255, EOD 256, no file (train with NullTokenizer --vocab-size 257)"
    group = parser.add_argument_group("documents")
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
