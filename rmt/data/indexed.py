"""Opening megatron-core indexed datasets (``.bin``/``.idx``, written by :mod:`rmt.data.shards`
or other tools) with clear errors for missing, truncated or corrupt files; the ``.json``
sidecar records the tokenizer, vocabulary size, end-of-document id and largest token id, so
training can reject out-of-range ids before it starts."""

from __future__ import annotations

import os

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from rmt.data.metadata import read_metadata
from rmt.data.shards import IDX_HEADER, IDX_MAGIC
from rmt.errors import UserError


def _check_idx(path: str) -> None:
    """Header and size checks of a megatron ``.idx`` file, before megatron-core maps it
    (its reader asserts, and then fails again in ``__del__``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(IDX_HEADER.size)
    if len(head) < IDX_HEADER.size:
        raise UserError(
            f"dataset index '{path}' is corrupt or truncated ({size} bytes, header needs {IDX_HEADER.size})"
        )
    magic, version, _, sequences, documents = IDX_HEADER.unpack(head)
    if magic != IDX_MAGIC or version != 1:
        raise UserError(f"dataset index '{path}' is corrupt or truncated (not a megatron-core index file)")
    needed = IDX_HEADER.size + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise UserError(f"dataset index '{path}' is corrupt or truncated ({size} bytes, its header describes {needed})")


def open_indexed(prefix: str) -> IndexedDataset:
    """Open ``prefix.bin/.idx``, turning a missing, truncated or corrupt file into one sentence."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise UserError(f"dataset '{prefix}' has no '{prefix}{ext}' (run rmt-preprocess first)")
    _check_idx(prefix + ".idx")
    ds = IndexedDataset(prefix, mmap=True)
    lengths, pointers = ds.index.sequence_lengths, ds.index.sequence_pointers
    if len(lengths) == 0:
        raise UserError(f"dataset '{prefix}' holds no documents")
    expected = int(pointers[-1]) + int(lengths[-1]) * ds.index.dtype_size
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise UserError(
            f"dataset '{prefix}.bin' has {actual} bytes but its index describes {expected}: "
            "the files are truncated or do not belong together"
        )
    return ds


def max_token_id(prefix: str, ds: IndexedDataset) -> int:
    meta = read_metadata(prefix)
    if meta is not None and "max_token_id" in meta:
        return int(meta["max_token_id"])
    return int(np.max(np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")))
