"""The files a job on Megatron-LM's training loop reads, checked before it starts.

Responsible for refusing, on the flags Megatron's own parser read and before any process group,
model or output file exists, a job that megatron-core would stop on mid-start (a traceback from
every rank) or hang on:

- every data prefix that ``--data-path``, ``--data-args-path``, ``--train-data-path``,
  ``--valid-data-path``, ``--test-data-path`` or ``--per-split-data-args-path`` names exists and its
  ``.idx``/``.bin`` agree (``data.indexed_files``);
- every split that ``--split`` gives a share gets a document of every prefix (``data.splits``);
- the ``--load`` checkpoint that Megatron would resume from is whole (``checkpoint_files``);
- the tokenizer files that ``--tokenizer-type`` reads (``--vocab-file``, ``--merge-file``,
  ``--tokenizer-model``) exist.

Every rank checks the same files on its own (no group exists yet to share a verdict), reading
headers and archive directories only; rank 0 alone says why, every rank exits 2. It also gives the
datasets' index caches a home outside the data (``with_data_cache_path``): megatron-core otherwise
writes them into a ``cache`` folder beside the data. It never writes; object-storage paths
(``s3://``, ``msc://``) are left to megatron-core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron.resihp.checkpoint_files import check_checkpoint
from megatron.resihp.data.datasets import default_data_cache_path
from megatron.resihp.data.indexed_files import check_indexed_dataset
from megatron.resihp.data.splits import SPLIT_NAMES, check_prefix_has_documents, check_split_documents

PROG = "pretrain_gpt_resilient.py"
INPUT_ERROR_EXIT = 2
# Megatron's validate_args falls back to this split when --data-path comes without --split.
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"
_PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def reads_data_files(args: argparse.Namespace) -> bool:
    """Whether the job reads indexed data files (not ``--mock-data``)."""
    named = (args.data_path, args.data_args_path, args.train_data_path, args.valid_data_path, args.test_data_path,
             args.per_split_data_args_path)
    return not args.mock_data and any(v is not None for v in named)


def with_data_cache_path(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """``argv`` with ``--data-cache-path`` set to the user's cache folder when it reads data files and names none.

    Args:
        args: ``argv`` as Megatron's parser read it.
        argv: the command line.

    Returns:
        The command line Megatron is to parse.
    """
    if args.data_cache_path is not None or not reads_data_files(args):
        return argv
    return ["--data-cache-path", default_data_cache_path(), *argv]


def check_inputs(args: argparse.Namespace, defaults: dict | None = None) -> None:
    """Raise ``ValueError`` naming the flag, the file and the fix for the first input the job could not use.

    Args:
        args: the command line as Megatron's parser read it (not yet validated).
        defaults: the ``args_defaults`` the script hands Megatron (a ``tokenizer_type`` among them).
    """
    _check_tokenizer_files(args.tokenizer_type or (defaults or {}).get("tokenizer_type"), args)
    if reads_data_files(args):
        _check_data(args)
    # With --ckpt-step Megatron resumes from that iteration, not the one the tracker names.
    if args.load and not _remote(args.load) and os.path.exists(args.load) and args.ckpt_step is None:
        check_checkpoint(args.load)  # a --load folder that does not exist yet is a fresh start


def refuse_bad_inputs(args: argparse.Namespace, defaults: dict | None = None) -> None:
    """Exit 2 when ``check_inputs`` refuses, the reason printed by rank 0 alone."""
    try:
        check_inputs(args, defaults)
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(INPUT_ERROR_EXIT)


def _check_data(args: argparse.Namespace) -> None:
    if args.data_path is not None or args.data_args_path is not None:
        flag, words = "--data-path", args.data_path
        if args.data_args_path is not None:
            flag = f"--data-args-path {args.data_args_path}"
            words = _read_text(flag, args.data_args_path).split()
            if args.split is None:  # Megatron falls back to a default split for --data-path only
                raise ValueError(f"{flag} needs --split (Megatron gives it no default); e.g. --split 969,30,1")
        documents = _documents(flag, words)
        if args.split is None:
            check_split_documents(MEGATRON_DEFAULT_SPLIT, documents,
                                  f"--split (not given: Megatron's default {MEGATRON_DEFAULT_SPLIT!r})")
        else:
            check_split_documents(args.split, documents)
        return
    if args.per_split_data_args_path is not None:
        flag = f"--per-split-data-args-path {args.per_split_data_args_path}"
        blends = _per_split_blends(args.per_split_data_args_path)
        flags = [f"{flag} ({key!r})" for key in ("train", "valid", "test")]
    else:
        blends = [args.train_data_path, args.valid_data_path, args.test_data_path]
        flags = list(_PER_SPLIT_FLAGS)
    for name, flag, words in zip(SPLIT_NAMES, flags, blends):
        if words is not None:
            check_prefix_has_documents(flag, name, _documents(flag, words))


def _documents(flag: str, words: list[str]) -> dict[str, int]:
    """The document count of each prefix of a blend, read as megatron-core reads the blend."""
    from megatron.core.datasets.utils import get_blend_from_list

    if not words:
        raise ValueError(f"{flag} names no prefix; give PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...'")
    try:
        prefixes, _ = get_blend_from_list(list(words))
    except (AssertionError, ValueError):
        raise ValueError(f"{flag} {' '.join(words)!r}: give prefixes, or weight-prefix pairs with every "
                         "weight a number") from None
    return {p: check_indexed_dataset(p, flag) for p in prefixes if not _remote(p)}


def _per_split_blends(path: str) -> list[list[str] | None]:
    flag = f"--per-split-data-args-path {path}"
    try:
        blends = json.loads(_read_text(flag, path))
    except ValueError as err:
        raise ValueError(f"{flag} does not parse as JSON ({err}); write {{\"train\": ..., \"valid\": ..., "
                         "\"test\": ...}") from None
    missing = [k for k in ("train", "valid", "test") if not isinstance(blends, dict) or k not in blends]
    if missing:
        raise ValueError(f"{flag} has no {missing[0]!r} entry; give each of 'train', 'valid' and 'test' a list "
                         "of prefixes (or null)")
    return [b.split() if isinstance(b, str) else b for b in (blends["train"], blends["valid"], blends["test"])]


def _read_text(flag: str, path: str) -> str:
    if _remote(path):
        raise ValueError(f"{flag}: a data-arguments file in object storage is not checked here; copy it to a "
                         "local file")
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"{flag} cannot be read ({err.strerror}); give the file that lists the data prefixes") \
            from None


def _check_tokenizer_files(kind: str | None, args: argparse.Namespace) -> None:
    from megatron.core.tokenizers.utils.build_tokenizer import MEGATRON_TOKENIZERS, SP_TOKENIZERS

    # Which files each tokenizer type reads, as Megatron's build_tokenizer passes them on.
    files = []
    if kind in MEGATRON_TOKENIZERS or kind == "HuggingFaceTokenizer":
        files += [("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)]
    if kind in SP_TOKENIZERS or kind == "TikTokenizer":
        files.append(("--tokenizer-model", args.tokenizer_model))
    elif kind == "HuggingFaceTokenizer" and args.tokenizer_model and args.tokenizer_model.startswith(("/", ".", "~")):
        files.append(("--tokenizer-model", args.tokenizer_model))  # else a model name on the Hugging Face hub
    for flag, path in files:
        if path and not os.path.exists(os.path.expanduser(path)):
            raise ValueError(f"{flag} {path} not found; give the {kind}'s file (or another --tokenizer-type)")


def _remote(path: str) -> bool:
    return "://" in str(path)
