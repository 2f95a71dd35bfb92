"""Document structure of token batches: segment lengths and cost-model features.

Responsible for reading, from the tokens of a micro-batch, where its documents start and end
(EOD-delimited, the EOD belonging to the document it ends) and for turning that into the
``(num_tokens, sum of squared document lengths)`` features the iteration-time predictor and the
detector use. The convention matches megatron's ``reset_attention_mask``: a token after an EOD
cannot see anything up to and including that EOD.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resihp_ext.workload import microbatch_features as _features_from_lengths


def document_lengths(tokens: torch.Tensor, eod: int) -> list[list[int]]:
    """Lengths of the EOD-delimited segments of each sample.

    Args:
        tokens: LongTensor [b, s] (a 1-D [s] tensor is taken as one sample).
        eod: The end-of-document id.

    Returns:
        Per sample, its segment lengths in order; each list sums to ``s``. A segment that runs
        to the end of the sample without an EOD (a document cut by the sample boundary) counts as
        a segment of its own.
    """
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, s] or [s], got shape {tuple(tokens.shape)}")
    seq_length = tokens.size(1)
    result: list[list[int]] = []
    # One nonzero() over the whole batch (and one host copy), then plain Python per sample.
    rows, cols = (tokens == eod).nonzero(as_tuple=True)
    rows, cols = rows.tolist(), cols.tolist()
    ends_per_row: list[list[int]] = [[] for _ in range(tokens.size(0))]
    for r, c in zip(rows, cols):
        ends_per_row[r].append(c + 1)
    for ends in ends_per_row:
        if not ends or ends[-1] != seq_length:
            ends.append(seq_length)
        lengths = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
        result.append(lengths)
    return result


def document_bounds(tokens: torch.Tensor, eod: int) -> list[int]:
    """Cumulative segment boundaries over the batch flattened sample by sample, on the host.

    Args:
        tokens: LongTensor [b, s].
        eod: The end-of-document id.

    Returns:
        ``[0, e_1, ..., b * s]``: segment ``i`` covers flat positions ``[e_i, e_{i+1})`` where flat
        position ``j * s + t`` is token ``t`` of sample ``j``. Sample boundaries are always
        segment boundaries.
    """
    bounds = [0]
    offset = 0
    for sample in document_lengths(tokens, eod):
        for length in sample:
            offset += length
            bounds.append(offset)
    return bounds


def microbatch_features(bounds: Sequence[int]) -> tuple[int, int, int]:
    """Cost-model features of one micro-batch.

    Args:
        bounds: Its segment boundaries, from :func:`document_bounds` (or a ``DocumentBounds``'
            ``bounds``, so the forward step finds the documents once).

    Returns:
        ``(num_tokens, sum_sq, num_docs)``: ``b * s``, the sum of squared segment lengths and the
        number of segments.
    """
    return _features_from_lengths([[end - start for start, end in zip(bounds, bounds[1:])]])
