"""Datasets megatron-core does not have: mock documents of variable length, and where index caches go.

Responsible for ``--mock-doc-lengths``: with ``--mock-data``, a stream of documents whose lengths
follow a heavy-tailed distribution (:mod:`resihp_ext.workload`), each ending in EOD so megatron's
``reset_attention_mask`` / ``reset_position_ids`` / ``eod_mask_loss`` see the boundaries, as a
megatron-core ``MockGPTDataset`` that Megatron's dataset builder makes
(``gpt_pretrain.datasets_provider``); and for the default ``--data-cache-path``. It never decides
which samples a rank reads; that is the sampler's job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron.core.datasets.gpt_dataset import (
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from resihp_ext.workload import LengthDistribution, sample_document_lengths


@dataclass
class ResiHPGPTDatasetConfig(GPTDatasetConfig):
    """megatron-core's GPT dataset config plus the variable-length mock workload."""

    mock_doc_lengths: Optional[str] = None
    """``--mock-doc-lengths`` spec, e.g. ``lognormal:median=48,sigma=1.0,min=8,max=1024``."""


class VariableLengthMockLowLevelDataset(MockGPTLowLevelDataset):
    """Mock documents with lengths drawn from a :class:`LengthDistribution`.

    Each document of length ``l`` is ``l - 1`` content tokens followed by EOD, so the segment
    lengths that :func:`megatron.resihp.data.batch.document_lengths` recovers are the drawn
    lengths (up to the cuts at sample boundaries). Content tokens never equal EOD, so no boundary
    appears where none was drawn.

    Args:
        tokenizer: Supplies ``vocab_size`` and ``eod``.
        dist: Length distribution.
        seed: Seed of the length draw (``--seed``), so every rank sees the same documents.
    """

    def __init__(self, tokenizer, dist: LengthDistribution, seed: int) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        if self.vocab_size < 2:
            raise ValueError("--mock-doc-lengths needs a tokenizer with vocab_size >= 2")
        rng = np.random.default_rng(seed)
        self.sequence_lengths = sample_document_lengths(rng, dist, self.size).astype(np.int32)

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        # Offset by the document index so documents differ; skip the EOD id among content tokens.
        content = (np.arange(length - 1, dtype=np.int64) + 1 + idx) % (self.vocab_size - 1)
        content[content >= self.eod_token] += 1
        return np.concatenate([content, np.array([self.eod_token], dtype=np.int64)])


class VariableLengthMockGPTDataset(MockGPTDataset):
    """``MockGPTDataset`` over :class:`VariableLengthMockLowLevelDataset` documents."""

    @staticmethod
    def build_low_level_dataset(dataset_path, config):  # type: ignore[override]
        dist = LengthDistribution.parse(config.mock_doc_lengths)
        return VariableLengthMockLowLevelDataset(config.tokenizer, dist, config.random_seed)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        # The spec changes the samples, so it must be part of the dataset's identity.
        return MockGPTDataset._key_config_attributes() + ["mock_doc_lengths"]


def default_data_cache_path() -> str:
    """Where the datasets' index caches go when ``--data-cache-path`` names no folder.

    A folder of the user's cache (``$XDG_CACHE_HOME``, else ``~/.cache``): megatron-core would
    otherwise write its caches beside the data, which may be read-only, shared or someone else's.
    """
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "resihp-megatron", "data-cache")
