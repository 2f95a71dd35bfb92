"""Document lengths and cost features read from token batches."""

import torch

from megatron.resihp.data.batch import document_bounds, document_lengths, microbatch_features

EOD = 9


def test_document_lengths_eod_ends_its_document():
    tokens = torch.tensor([[1, 2, EOD, 3, EOD, 4, 5, 6], [EOD, 1, 1, 1, 1, 1, 1, EOD]])
    assert document_lengths(tokens, EOD) == [[3, 2, 3], [1, 7]]


def test_no_eod_is_one_document_and_1d_input():
    assert document_lengths(torch.tensor([1, 2, 3]), EOD) == [[3]]
    assert document_lengths(torch.tensor([[1, 2, 3], [1, 2, EOD]]), EOD) == [[3], [3]]


def test_lengths_sum_to_sequence_length():
    tokens = torch.randint(0, 12, (5, 64), generator=torch.Generator().manual_seed(0))
    assert all(sum(row) == 64 for row in document_lengths(tokens, EOD))


def test_document_bounds_flatten_sample_by_sample():
    tokens = torch.tensor([[1, EOD, 2, 3], [4, 5, EOD, 6]])
    assert document_bounds(tokens, EOD) == [0, 2, 4, 7, 8]


def test_microbatch_features():
    tokens = torch.tensor([[1, 2, EOD, 3, EOD, 4, 5, 6], [EOD, 1, 1, 1, 1, 1, 1, EOD]])
    assert microbatch_features(document_bounds(tokens, EOD)) == (16, 9 + 4 + 9 + 1 + 49, 5)
