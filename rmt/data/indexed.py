"""megatron-core indexed datasets (``.bin``/``.idx``) plus a small ``.json`` sidecar that
records the tokenizer, vocabulary size, end-of-document id and largest token id, so training
can reject out-of-range ids before it starts."""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, List

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from rmt.data.metadata import read_metadata
from rmt.errors import UserError


def _dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def write_indexed(prefix: str, documents: Iterable[List[int]], tokenizer) -> dict:
    """Write token documents (each followed by EOD) to ``prefix.bin/.idx/.json`` atomically:
    the files are written under a temporary name and renamed once complete."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = prefix + ".tmp"
    dtype = _dtype_for(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    num_docs = num_tokens = max_id = 0
    for ids in documents:
        ids = list(ids) + [tokenizer.eod]
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
        builder.end_document()
        num_docs += 1
        num_tokens += len(ids)
        max_id = max(max_id, max(ids))
    builder.finalize(tmp + ".idx")
    meta = {"tokenizer": tokenizer.spec, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "num_documents": num_docs, "num_tokens": num_tokens, "max_token_id": max_id}
    with open(tmp + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    for ext in (".bin", ".idx", ".json"):
        os.replace(tmp + ext, prefix + ext)
    return meta


_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents


def _check_idx(path: str) -> None:
    """Header and size checks of a megatron ``.idx`` file, before megatron-core maps it
    (its reader asserts, and then fails again in ``__del__``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_IDX_HEADER.size)
    if len(head) < _IDX_HEADER.size:
        raise UserError(f"dataset index '{path}' is corrupt or truncated ({size} bytes, header needs {_IDX_HEADER.size})")
    magic, version, _, sequences, documents = _IDX_HEADER.unpack(head)
    if magic != _IDX_MAGIC or version != 1:
        raise UserError(f"dataset index '{path}' is corrupt or truncated (not a megatron-core index file)")
    needed = _IDX_HEADER.size + sequences * (4 + 8) + documents * 8
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
            "the files are truncated or do not belong together")
    return ds


def max_token_id(prefix: str, ds: IndexedDataset) -> int:
    meta = read_metadata(prefix)
    if meta is not None and "max_token_id" in meta:
        return int(meta["max_token_id"])
    return int(np.max(np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")))
