"""Byte sizes that the memory tables and the planner share, torch-free: the element sizes of the
precisions, the element size of a lookup's scores and pooled outputs, and the chunk a table
checkpoint reads and stages at a time."""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of each ``train.precision`` and ``memory.value_dtype``."""

CHECKPOINT_CHUNK_BYTES = 64 << 20
"""The most :mod:`rmt.training.table_checkpoint` reads or stages at once (a resharding load's
read of a saved block, a GPU save's host copy); the planner counts it in those phases' peaks."""


def lookup_bytes(precision: str, value_dtype: str) -> int:
    """Bytes per score and pooled-output element of a lookup: the training precision's, widened
    to the table's when the table is wider (bf16 scores of a float32 table are widened to
    float32, :meth:`rmt.memory.table.MemoryTable.lookup_reduce`)."""
    return max(DTYPE_BYTES[precision], DTYPE_BYTES[value_dtype])
