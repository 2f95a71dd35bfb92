"""How many documents of a corpus each split gets, and a refusal where a split megatron-core builds gets none.

Responsible for one rule, applied to the ``.idx`` document counts before anything is built:
megatron-core's GPT builder builds every split that ``--split`` gives a share (whatever
``--eval-iters`` says: a split needing 0 samples still asks for one token), and on a split whose
document range is empty its epoch count loop never ends (found with a 40-document corpus and the
default split 969,30,1, whose test split gets no document). The shares are parsed and bounded by
megatron-core's own ``--split`` functions; each split then gets the documents between the rounded
bounds, as the builder indexes them. With per-split prefixes each prefix is a split of its own.
Reads nothing but the counts it is given; never writes.
"""

from __future__ import annotations

import math
import re

import numpy

SPLIT_NAMES = ("train", "validation", "test")


def split_document_counts(split: str, num_documents: int) -> list[int | None]:
    """The documents of a prefix that each split gets, as megatron-core's GPT builder splits them.

    Args:
        split: a ``--split`` value, e.g. ``"969,30,1"``.
        num_documents: the sequences in the prefix's ``.idx``.

    Returns:
        For train, validation and test: the document count, or None for a split without a share
        (megatron-core does not build it).

    Raises:
        ValueError: ``split`` does not give three non-negative shares, one of them positive.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        with numpy.errstate(invalid="ignore", divide="ignore"):
            shares = parse_and_normalize_split(split)
    except (AssertionError, ValueError):
        shares = [math.nan]
    if any(math.isnan(s) for s in shares):
        raise ValueError(f"--split {split!r}: give up to three non-negative shares (train, validation, test), "
                         "at least one of them positive, e.g. --split 969,30,1")
    counts: list[int | None] = []
    for bounds in convert_split_vector_to_split_matrix(shares):
        if bounds is None:
            counts.append(None)
        else:
            begin, end = (int(round(b * float(num_documents))) for b in bounds)
            counts.append(end - begin)
    return counts


def check_split_documents(split: str, documents: dict[str, int], split_flag: str | None = None) -> None:
    """Raise ``ValueError`` naming ``--split`` unless every split it gives a share gets a document of each prefix.

    Args:
        split: the ``--split`` value the job runs with.
        documents: the document count of each prefix of the blend, by prefix.
        split_flag: how the message names the split (default ``--split SPLIT``).

    Raises:
        ValueError: a split would have no document of some prefix; the message gives the counts and the fix.
    """
    split_flag = split_flag or f"--split {split}"
    for prefix, num_documents in documents.items():
        counts = split_document_counts(split, num_documents)
        empty = [i for i, n in enumerate(counts) if n == 0]
        if not empty:
            continue
        name = SPLIT_NAMES[empty[0]]
        given = ", ".join(f"{SPLIT_NAMES[i]} {'no share' if n is None else n}" for i, n in enumerate(counts))
        suggested = _without(split, empty)
        if empty[0] == 0:
            fix = "give the train split a larger share"
        elif 0 in split_document_counts(suggested, num_documents):
            fix = f"give the {name} split a share of 0 (megatron-core then does not build it) or a larger one"
        else:
            fix = (f"give the {name} split a share of 0 (megatron-core then does not build it; "
                   f"--split {suggested}) or a larger one")
        raise ValueError(
            f"{split_flag}: the {name} split gets none of the {num_documents} documents of {prefix} ({given}); "
            f"megatron-core builds every split with a share, whatever --eval-iters says, and never finishes "
            f"building one without a document; {fix}, or use a corpus with more documents")


def check_prefix_has_documents(flag: str, name: str, documents: dict[str, int]) -> None:
    """Raise ``ValueError`` naming ``flag`` when a prefix that is a whole split holds no document.

    Args:
        flag: the flag that named the split's prefixes (``--train-data-path``, ...).
        name: the split, for the message.
        documents: the document count of each prefix, by prefix.
    """
    for prefix, num_documents in documents.items():
        if num_documents == 0:
            raise ValueError(f"{flag}: {prefix} holds no document, so the {name} split would have none and "
                             "megatron-core would never finish building it; give a prefix with documents")


def _without(split: str, splits: list[int]) -> str:
    """``split`` with the shares of ``splits`` set to 0, written as three numbers."""
    shares = re.findall(r"[.0-9]+", split) + ["0"] * 3
    return ",".join("0" if i in splits else shares[i] for i in range(3))
