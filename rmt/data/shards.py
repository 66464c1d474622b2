"""megatron-core's indexed dataset format (``.bin``/``.idx``), written with numpy alone: the
shards ``rmt-preprocess``'s workers tokenize into, and their merge.

The bytes are exactly those of megatron-core's ``IndexedDatasetBuilder`` (``add_document`` per
document, ``add_index`` to merge; both tested to be equal), which is the reference. It is not
used here because it needs torch (seconds of import in every worker process) and holds the
whole index in Python lists (~70 bytes a document) until it writes it; here a shard buffers
its own index only and a merge streams the shards' indexes, so memory does not grow with the
input. The ``.json`` sidecar is :mod:`rmt.data.metadata`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Iterable, List, Sequence

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version 1, dtype code, sequences, documents
_DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}  # megatron-core's DType


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype megatron-core stores ``vocab_size`` ids in (as rmt has always)."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def metadata(tokenizer_spec: str, vocab_size: int, eod: int, num_docs: int, num_tokens: int, max_id: int) -> dict:
    return {
        "tokenizer": tokenizer_spec,
        "vocab_size": vocab_size,
        "eod": eod,
        "num_documents": num_docs,
        "num_tokens": num_tokens,
        "max_token_id": max_id,
    }


def publish(tmp: str, prefix: str, meta: dict) -> dict:
    """Write ``tmp.json`` and rename ``tmp.bin/.idx/.json`` to ``prefix.*`` (complete or absent)."""
    with open(tmp + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    for ext in (".bin", ".idx", ".json"):
        os.replace(tmp + ext, prefix + ext)
    return meta


def _write_header(f, dtype: np.dtype, sequences: int) -> None:
    # one sequence per document: document_indices = 0, 1, ..., sequences
    f.write(IDX_HEADER.pack(IDX_MAGIC, 1, _DTYPE_CODES[dtype], sequences, sequences + 1))


def write_indexed(prefix: str, documents: Iterable[Sequence[int]], tokenizer) -> dict:
    """Documents of token ids, each followed by the end-of-document id, as ``prefix.bin/.idx/
    .json`` (atomically: written under a temporary name, renamed once complete)."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = prefix + ".tmp"
    lengths: List[int] = []
    num_tokens = max_id = 0
    with open(tmp + ".bin", "wb") as data:
        for ids in documents:
            arr = np.empty(len(ids) + 1, dtype=np.int64)
            arr[:-1] = ids
            arr[-1] = tokenizer.eod
            data.write(arr.astype(dtype).tobytes())
            lengths.append(arr.size)
            num_tokens += arr.size
            max_id = max(max_id, int(arr.max()))
    sizes = np.asarray(lengths, dtype=np.int64)
    with open(tmp + ".idx", "wb") as f:
        _write_header(f, dtype, sizes.size)
        f.write(sizes.astype(np.int32).tobytes())
        f.write(((np.cumsum(sizes) - sizes) * dtype.itemsize).tobytes())  # byte offset of each
        f.write(np.arange(sizes.size + 1, dtype=np.int64).tobytes())
    return publish(
        tmp, prefix, metadata(tokenizer.spec, tokenizer.vocab_size, tokenizer.eod, sizes.size, num_tokens, max_id)
    )


def _index(prefix: str):
    """``(lengths, pointers)`` of a shard's index (memory-mapped)."""
    with open(prefix + ".idx", "rb") as f:
        n = IDX_HEADER.unpack(f.read(IDX_HEADER.size))[3]
    raw = np.memmap(prefix + ".idx", dtype=np.uint8, mode="r")
    lengths = raw[IDX_HEADER.size : IDX_HEADER.size + 4 * n].view(np.int32)
    pointers = raw[IDX_HEADER.size + 4 * n : IDX_HEADER.size + 12 * n].view(np.int64)
    return lengths, pointers


def _append(path: str, out) -> None:
    """Append the file ``path`` to the open file ``out``: in the kernel where it can
    (``copy_file_range``: no copy through this process, a reflink on some file systems)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        copied = 0
        if hasattr(os, "copy_file_range"):
            out.flush()
            try:
                while copied < size:
                    n = os.copy_file_range(f.fileno(), out.fileno(), size - copied)
                    if n == 0:
                        break
                    copied += n
            except OSError:  # not supported between these files: copy through user space
                pass
            out.seek(0, os.SEEK_END)
        f.seek(copied)
        shutil.copyfileobj(f, out, 1 << 24)


def merge_indexed(prefix: str, parts: List[str]) -> dict:
    """Concatenate the shards ``parts`` (one tokenizer) into ``prefix``, atomically, streaming
    one shard's index at a time and copying the data file to file."""
    metas = []
    for part in parts:
        with open(part + ".json") as f:
            metas.append(json.load(f))
    first = metas[0]
    dtype = token_dtype(first["vocab_size"])
    sequences = sum(int(m["num_documents"]) for m in metas)
    tmp = prefix + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(tmp + ".idx", "wb") as f:
        _write_header(f, dtype, sequences)
        for part in parts:
            f.write(np.asarray(_index(part)[0]).tobytes())
        offset = 0
        for part in parts:
            f.write((_index(part)[1] + np.int64(offset)).tobytes())
            offset += os.path.getsize(part + ".bin")
        for start in range(0, sequences + 1, 1 << 20):
            f.write(np.arange(start, min(start + (1 << 20), sequences + 1), dtype=np.int64).tobytes())
    with open(tmp + ".bin", "wb") as out:
        for part in parts:
            _append(part + ".bin", out)
    return publish(
        tmp,
        prefix,
        metadata(
            first["tokenizer"],
            first["vocab_size"],
            first["eod"],
            sequences,
            sum(int(m["num_tokens"]) for m in metas),
            max(int(m["max_token_id"]) for m in metas),
        ),
    )
