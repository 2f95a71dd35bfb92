"""Whether a Megatron indexed dataset (PREFIX.idx + PREFIX.bin) is whole, checked before training.

Responsible for reading an index's header and the last entries of its arrays, and comparing them
with the sizes of both files: a truncated ``.idx`` or ``.bin``, an unknown dtype or a wrong header
is named with the file and the fix, as a ``ValueError`` raised before any process group or output
file exists. It reads a few hundred bytes per prefix, whatever the corpus size, and never writes.
The format is megatron-core's (``megatron/core/datasets/indexed_dataset.py``), whose header
constant and dtype codes it uses.
"""

from __future__ import annotations

import os
import struct

import numpy
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

# header, version <Q, dtype code <B, sequence count <Q, document count <Q
_FIXED_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8
_FIX = "rewrite it with tools/preprocess_data.py"


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> int:
    """Raise ``ValueError`` naming ``flag`` and the file unless ``prefix``'s files agree.

    Args:
        prefix: a data prefix, without ``.idx``/``.bin``.
        flag: the flag that named the prefix, for the message.

    Returns:
        The number of sequences the index holds: what megatron-core's GPT dataset splits by
        ``--split`` (one per document, as ``tools/preprocess_data.py`` writes them).

    Raises:
        ValueError: a file is missing, truncated, or not an index of megatron-core's format.
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise ValueError(f"{flag}: {path} not found; give the prefix without suffix, as written by "
                             "tools/preprocess_data.py")
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as stream:
        fixed = stream.read(_FIXED_BYTES)
        if len(fixed) < _FIXED_BYTES or not fixed.startswith(_INDEX_HEADER):
            raise ValueError(f"{flag}: {idx} is not a Megatron index (header missing or cut short); {_FIX}")
        offset = len(_INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", fixed, offset)
        (code,) = struct.unpack_from("<B", fixed, offset + 8)
        num_sequences, num_documents = struct.unpack_from("<QQ", fixed, offset + 9)
        if version != 1:
            raise ValueError(f"{flag}: {idx} has index version {version}, megatron-core reads version 1; {_FIX}")
        try:
            dtype = numpy.dtype(DType.dtype_from_code(code))
        except (KeyError, ValueError):
            raise ValueError(f"{flag}: {idx} names token dtype code {code}, which megatron-core does not know; "
                             f"{_FIX}") from None
        # int32 lengths, int64 pointers and int64 document starts follow; multimodal indexes add
        # one int8 mode per sequence.
        arrays = 4 * num_sequences + 8 * num_sequences + 8 * num_documents
        if idx_size not in (_FIXED_BYTES + arrays, _FIXED_BYTES + arrays + num_sequences):
            raise ValueError(
                f"{flag}: {idx} is {idx_size} bytes but its header describes {num_sequences} sequences and "
                f"{num_documents} document boundaries ({_FIXED_BYTES + arrays} bytes): it is truncated or "
                f"corrupt; {_FIX}")
        if num_sequences == 0:
            expected_bin = 0
        else:
            stream.seek(_FIXED_BYTES + 4 * (num_sequences - 1))
            (last_length,) = struct.unpack("<i", stream.read(4))
            stream.seek(_FIXED_BYTES + 4 * num_sequences + 8 * (num_sequences - 1))
            (last_pointer,) = struct.unpack("<q", stream.read(8))
            expected_bin = last_pointer + last_length * dtype.itemsize
    if bin_size != expected_bin:
        raise ValueError(
            f"{flag}: {bin_} is {bin_size} bytes but {idx} places its last token at byte {expected_bin} "
            f"({dtype.name} tokens): the two files do not belong together or one is truncated; {_FIX}")
    return num_sequences
