"""Build the train/valid/test GPT datasets with megatron-core's dataset builder.

Responsible for turning the data flags (``--data-path``, ``--split``, ``--mock-data``,
``--mock-doc-lengths``, ``--seq-length``, ...) into megatron-core ``GPTDataset`` /
``MockGPTDataset`` objects. Real data comes from ``.bin/.idx`` files written by
``tools/preprocess_data.py``; mock data is either megatron's own or, with
``--mock-doc-lengths``, a stream of documents whose lengths follow a heavy-tailed distribution
(:mod:`resihp_ext.workload`), ending in EOD so megatron's ``reset_attention_mask`` /
``reset_position_ids`` / ``eod_mask_loss`` see the boundaries.

Works without ``torch.distributed`` and with it: when a process group exists, megatron-core
builds the index caches on rank 0 first and the other ranks wait on a barrier of the default
group, so every rank of the world must call :func:`build_pretraining_datasets` together.
It never decides which samples a rank reads; that is the sampler's job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.utils import get_blend_from_list
from megatron.resihp.data.indexed_files import check_indexed_dataset
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


def parse_data_path(data_path: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """Parse ``--data-path`` ("PREFIX" ... or "W1 PREFIX1 W2 PREFIX2" ...).

    Args:
        data_path: The flag's values; items may themselves hold several space-separated words.

    Returns:
        ``(prefixes, weights)``, weights None when not given.

    Raises:
        ValueError: Bad weights, or a prefix whose ``.bin``/``.idx`` files are missing or disagree.
    """
    words = [w for item in data_path for w in str(item).split()]
    if not words:
        raise ValueError("--data-path is empty; give PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...'")
    looks_weighted = len(words) % 2 == 0 and _is_number(words[0])
    if looks_weighted:
        for w in words[0::2]:
            if not _is_number(w) or float(w) < 0:
                raise ValueError(f"--data-path: weight {w!r} is not a non-negative number")
    try:
        blend = get_blend_from_list(words)
    except Exception as err:  # megatron raises bare exceptions here; name the flag instead
        raise ValueError(f"--data-path {' '.join(words)!r} is malformed: {err}") from None
    prefixes, weights = blend
    for prefix in prefixes:
        check_indexed_dataset(prefix)
    return list(prefixes), (list(weights) if weights is not None else None)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def build_pretraining_datasets(
    *,
    data_path: list[str] | None,
    split: str,
    mock_data: bool,
    seq_length: int,
    seed: int,
    tokenizer,
    num_samples: tuple[int, int, int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
    path_to_cache: str | None,
    mock_doc_lengths: str | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
):
    """Build the train, validation and test datasets.

    Must be called on every rank of the default process group together when one exists
    (megatron-core synchronises cache building with barriers on it).

    Args:
        data_path: ``--data-path`` prefixes, optionally weighted; None with ``mock_data``.
        split: ``--split``, e.g. ``"969,30,1"``.
        mock_data: ``--mock-data``: synthetic tokens instead of files.
        seq_length: ``--seq-length``: tokens per sample.
        seed: ``--seed``: shuffling and mock-length seed.
        tokenizer: From :func:`megatron.resihp.data.tokenizer.build_tokenizer`.
        num_samples: Samples wanted for (train, valid, test); 0 means that split is not needed.
        reset_position_ids: ``--reset-position-ids``: restart positions after each EOD.
        reset_attention_mask: ``--reset-attention-mask``: block attention across EOD.
        eod_mask_loss: ``--eod-mask-loss``: no loss on EOD tokens.
        create_attention_mask: Put a [1, s, s] boolean ``attention_mask`` in each sample.
        path_to_cache: ``--data-cache-path``; None caches next to the data (as does a blend of
            several paths built without ``torch.distributed``).
        mock_doc_lengths: ``--mock-doc-lengths`` spec; only with ``mock_data``.
        is_built_on_rank: Returns False on ranks that need no data (they get None); default
            builds on every rank.

    Returns:
        ``(train, valid, test)``; an entry is None for a split with zero weight or zero samples.

    Raises:
        ValueError: Inconsistent flags, naming them and the fix.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three counts >= 0 (train, valid, test), got {num_samples}")
    if mock_doc_lengths is not None and not mock_data:
        raise ValueError("--mock-doc-lengths only applies with --mock-data; add --mock-data or drop it")
    if mock_data and data_path:
        raise ValueError("--mock-data and --data-path are exclusive; drop one of them")
    if not mock_data and not data_path:
        raise ValueError("no data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    if mock_doc_lengths is not None:
        LengthDistribution.parse(mock_doc_lengths)  # fail here, not inside the builder

    blend = None if mock_data else parse_data_path(data_path)  # type: ignore[arg-type]
    if blend is not None and len(blend[0]) > 1 and not torch.distributed.is_initialized():
        # megatron-core 0.16.1's BlendedDataset asks torch.distributed for the rank whenever a
        # cache path is set, initialised or not; without a process group, keep its (cheap)
        # blending index in memory and let each GPTDataset cache next to its data files.
        path_to_cache = None
    config = ResiHPGPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mock_doc_lengths=mock_doc_lengths,
    )
    if not mock_data:
        dataset_cls = GPTDataset
    elif mock_doc_lengths is not None:
        dataset_cls = VariableLengthMockGPTDataset
    else:
        dataset_cls = MockGPTDataset
    # megatron-core treats a size of None as "the whole split"; we always know what we need.
    sizes = [int(n) for n in num_samples]
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls, sizes, is_built_on_rank or (lambda: True), config
    )
    train, valid, test = builder.build()
    return train, valid, test
