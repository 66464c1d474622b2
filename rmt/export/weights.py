"""The weights file of an export: safetensors, with memory value tables streamed from the
checkpoint's row blocks in chunks of bounded size, so that a table never sits whole in host
memory.

Written by hand because safetensors' ``save_file`` takes every tensor in memory at once. The
format (safetensors' specification): a little-endian u64 header size, a JSON header mapping
each name to ``dtype``, ``shape`` and ``data_offsets`` into the data that follows (plus
``__metadata__``), padded with spaces to a multiple of 8 bytes, then every tensor's bytes, C
order, in header order.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, Iterator, NamedTuple, Tuple

import torch

from rmt.errors import UserError

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Streamed(NamedTuple):
    """A tensor written from ``pieces()``: consecutive row chunks, C order."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Callable[[], Iterator[torch.Tensor]]


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _specs(tensors: Dict[str, torch.Tensor], streamed: Dict[str, Streamed]) -> dict:
    specs = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    specs.update((k, (s.shape, s.dtype)) for k, s in streamed.items())
    return specs


def _header(specs: dict) -> dict:
    """The safetensors header of tensors ``{name: (shape, dtype)}``, in name order."""
    header, offset = {}, 0
    for name in sorted(specs):
        shape, dtype = specs[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header


def data_bytes(tensors: Dict[str, torch.Tensor], streamed: Dict[str, Streamed]) -> int:
    """Bytes of the tensor data :func:`write_safetensors` writes for ``tensors`` and ``streamed``."""
    header = _header(_specs(tensors, streamed))
    return max((h["data_offsets"][1] for h in header.values()), default=0)


def write_safetensors(
    path: str, tensors: Dict[str, torch.Tensor], streamed: Dict[str, Streamed], metadata: Dict[str, str]
) -> None:
    """``tensors`` and ``streamed`` as one safetensors file ``path`` (written atomically)."""
    specs = _specs(tensors, streamed)
    header = _header(specs)
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(specs):
            start = f.tell()
            if name in tensors:
                f.write(_bytes(tensors[name]))
            else:
                for piece in streamed[name].pieces():
                    f.write(_bytes(piece))
            begin, end = header[name]["data_offsets"]
            if f.tell() - start != end - begin:
                raise RuntimeError(f"{name}: wrote {f.tell() - start} bytes, expected {end - begin}")
    os.replace(tmp, path)


def table_rows(root: str, key: str, shape: Tuple[int, int], chunk_bytes: int) -> Streamed:
    """The value table ``key`` of the checkpoint directory ``root`` (its saved row blocks, under
    any layout that saved them), in row chunks of at most ``chunk_bytes``."""
    from rmt.training.table_checkpoint import SAVED_DTYPES as SAVED
    from rmt.training.table_checkpoint import read_overlap, saved_blocks

    blocks = saved_blocks(root, key, "weight")
    if not blocks:
        raise UserError(f"checkpoint '{root}' holds no weight of memory table '{key}'")
    dtype = SAVED[blocks[0]["dtype"]]
    rows, cols = shape

    def pieces() -> Iterator[torch.Tensor]:
        step = max(1, chunk_bytes // (cols * torch.empty((), dtype=dtype).element_size()))
        buffer = torch.empty(min(step, rows), cols, dtype=dtype)
        for r in range(0, rows, step):
            target = buffer[: min(step, rows - r)]
            copied = sum(read_overlap(b, target, r, 0, chunk_bytes) for b in blocks)
            if copied != target.numel():
                raise UserError(
                    f"checkpoint '{root}' covers {copied} of the {target.numel()} values of rows "
                    f"{r}..{r + target.shape[0]} of memory table '{key}'"
                )
            yield target

    return Streamed((rows, cols), dtype, pieces)
