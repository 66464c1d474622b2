"""Memory value tables in checkpoints, streamed shard by shard.

A table (and each optimizer state of its size: Adam's moments, row-wise Adagrad's per-row sums)
never passes through one rank whole, neither when saved nor when loaded under another group size
or partition: each rank holding a main replica of a shard writes the shard's rows to
``tables/<key>/<tensor>.r<row0>.c<col0>.bin`` (raw, C order, the tensor's dtype) beside a JSON
descriptor of where the block sits in the global tensor, and a loading rank reads only the rows
of the saved blocks that overlap its new shard. Rows are read straight into the new shard when a
saved block has the shard's columns and dtype, otherwise through one buffer of at most
``chunk_bytes`` (dimension-wise blocks, dtype changes, GPU shards), so loading holds the new
shard plus one bounded chunk; saving a CPU shard copies nothing (a GPU shard goes through one
bounded host chunk).

Written by hand because megatron-core's torch_dist checkpoints cannot give that bound: its
writer clones every CPU view of a tensor before writing (so a shard saved in bounded pieces is
copied whole), and torch DCP's reader loads each saved item whole before narrowing it (so a shard
saved as one item costs a second, old-layout shard when loaded under another layout). The rest of
a checkpoint stays in megatron's format (:mod:`rmt.training.checkpoint`).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Tuple

import torch

from rmt.errors import UserError
from rmt.memory.byte_sizes import CHECKPOINT_CHUNK_BYTES
from rmt.memory.descriptor import descriptor, is_table
from rmt.parallel.sharding import Shard, shards

FORMAT = 1
STATES = ("exp_avg", "exp_avg_sq", "sum")  # Adam moments (AdamW, SparseAdam); RowWiseAdagrad's row sums
ROW_STATES = ("sum",)  # one value per table row
SAVED_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def table_shards(chunks: Iterable[torch.nn.Module]) -> List[Shard]:
    """The shard of every memory value table of ``chunks`` (parameters with a
    :class:`~rmt.memory.descriptor.TableDescriptor`)."""
    return [s for s in shards(chunks) if is_table(s.param)]


def table_tensors(shard: Shard, optimizer) -> Dict[str, torch.Tensor]:
    """``weight`` and the optimizer states of the table's size, each as ``[rows, cols]`` (a
    per-row state as ``[rows, 1]``)."""
    out = {"weight": shard.param.detach()}
    if optimizer is not None and shard.param in optimizer.state:
        state = optimizer.state[shard.param]
        out.update((name, state[name].view(state[name].shape[0], -1)) for name in STATES if name in state)
    return out


def _block(shard: Shard, name: str) -> Tuple[int, int, Tuple[int, int]]:
    """(row0, col0, global shape) of the tensor ``name`` of ``shard`` in its global tensor; a
    per-row state is one global column."""
    rows, cols = shard.index
    if name in ROW_STATES:
        return rows.start or 0, 0, (shard.global_shape[0], 1)
    return rows.start or 0, cols.start or 0, tuple(shard.global_shape)


def _paths(root: str, key: str, name: str, row0: int, col0: int) -> Tuple[str, str]:
    stem = os.path.join(root, "tables", key, f"{name}.r{row0}.c{col0}")
    return stem + ".bin", stem + ".json"


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def save_tables(root: str, chunks, optimizer, chunk_bytes: int = CHECKPOINT_CHUNK_BYTES) -> int:
    """Write this rank's main-replica table shards under ``root``; returns the bytes written."""
    written = 0
    for shard in table_shards(chunks):
        if not shard.is_main_replica:
            continue
        for name, tensor in table_tensors(shard, optimizer).items():
            if name in ROW_STATES and (shard.index[1].start or 0):
                continue  # the ranks of a dimension-wise group hold the same rows: the first writes them
            row0, col0, global_shape = _block(shard, name)
            data, meta = _paths(root, shard.key, name, row0, col0)
            os.makedirs(os.path.dirname(data), exist_ok=True)
            rows, cols = tensor.shape
            step = max(1, chunk_bytes // max(1, cols * tensor.element_size()))
            with open(data, "wb") as f:
                for r in range(0, rows, step):
                    piece = tensor[r : r + step]
                    if piece.device.type != "cpu" or not piece.is_contiguous():
                        piece = piece.contiguous().cpu()
                    f.write(_raw(piece))
            with open(meta, "w") as f:
                json.dump(
                    {
                        "format": FORMAT,
                        "global_shape": list(global_shape),
                        "row0": row0,
                        "col0": col0,
                        "rows": rows,
                        "cols": cols,
                        "dtype": str(tensor.dtype).removeprefix("torch."),
                    },
                    f,
                )
            written += tensor.numel() * tensor.element_size()
    return written


def saved_blocks(root: str, key: str, name: str) -> List[dict]:
    """The descriptors of the row blocks of tensor ``name`` of table ``key`` saved under ``root``
    (one per saving shard, any layout), each with the ``path`` of its raw file."""
    folder = os.path.join(root, "tables", key)
    blocks = []
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if entry.startswith(name + ".r") and entry.endswith(".json"):
            with open(os.path.join(folder, entry)) as f:
                meta = json.load(f)
            meta["path"] = os.path.join(folder, entry[: -len(".json")] + ".bin")
            blocks.append(meta)
    return blocks


def read_overlap(block: dict, target: torch.Tensor, row0: int, col0: int, chunk_bytes: int) -> int:
    """Copy the part of the saved ``block`` that overlaps ``target`` (the global block at
    ``(row0, col0)``); returns the elements copied."""
    r_a, r_b = max(row0, block["row0"]), min(row0 + target.shape[0], block["row0"] + block["rows"])
    c_a, c_b = max(col0, block["col0"]), min(col0 + target.shape[1], block["col0"] + block["cols"])
    if r_a >= r_b or c_a >= c_b:
        return 0
    dtype, width = SAVED_DTYPES[block["dtype"]], block["cols"]
    row_bytes = width * torch.finfo(dtype).bits // 8
    expected = block["rows"] * row_bytes
    if os.path.getsize(block["path"]) != expected:
        raise UserError(
            f"checkpoint file '{block['path']}' is truncated or corrupt "
            f"({os.path.getsize(block['path'])} bytes, expected {expected})"
        )
    direct = (
        dtype == target.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and (c_a, c_b) == (block["col0"], block["col0"] + width) == (col0, col0 + target.shape[1])
    )
    step = max(1, chunk_bytes // row_bytes)
    buffer = None
    with open(block["path"], "rb") as f:
        f.seek((r_a - block["row0"]) * row_bytes)
        for r in range(r_a, r_b, step):
            n = min(step, r_b - r)
            dst = target[r - row0 : r - row0 + n]
            if direct:
                f.readinto(_raw(dst))
                continue
            if buffer is None:
                buffer = torch.empty(min(step, r_b - r_a), width, dtype=dtype)
            f.readinto(_raw(buffer[:n]))
            dst[:, c_a - col0 : c_b - col0].copy_(buffer[:n, c_a - block["col0"] : c_b - block["col0"]])
    return (r_b - r_a) * (c_b - c_a)


def load_tables(root: str, chunks, optimizer, chunk_bytes: int = CHECKPOINT_CHUNK_BYTES) -> None:
    """Fill every table shard of ``chunks`` (and its optimizer states, which must exist) in place
    from the blocks saved under ``root``, whatever layout saved them; a host table's device cache
    forgets its rows (``memory.host_cache_rows``: the next refresh admits rows anew)."""
    for shard in table_shards(chunks):
        descriptor(shard.param).storage.forget_cache()
        for name, tensor in table_tensors(shard, optimizer).items():
            row0, col0, global_shape = _block(shard, name)
            blocks = saved_blocks(root, shard.key, name)
            if not blocks:
                raise UserError(f"checkpoint '{root}' holds no '{name}' of memory table '{shard.key}'")
            if tuple(blocks[0]["global_shape"]) != global_shape:
                raise UserError(
                    f"checkpoint '{root}': memory table '{shard.key}' {name} is "
                    f"{tuple(blocks[0]['global_shape'])}, this model's is {global_shape}"
                )
            with torch.no_grad():
                copied = sum(read_overlap(b, tensor, row0, col0, chunk_bytes) for b in blocks)
            if copied != tensor.numel():
                raise UserError(
                    f"checkpoint '{root}' covers {copied} of the {tensor.numel()} elements of "
                    f"this rank's shard of memory table '{shard.key}' {name}"
                )
