"""The memory value table behind every memory layer.

Layers reach their values only through :meth:`MemoryTable.lookup_reduce`, so the sharded
variants (number-wise / dimension-wise over a memory-parallel group) plug in here without
touching the layers.
"""

from __future__ import annotations

import torch

from rmt.ops import lookup_reduce

PARTITIONS = ("local",)


class MemoryTable(torch.nn.Module):
    """``num_slots x dim`` values on this rank (partition ``"local"``: the whole table).

    The weight carries ``memory_value = True`` (its own LR schedule in the optimizer) and
    ``memory_init_std`` (read by the layout-independent initialiser).
    """

    def __init__(self, num_slots: int, dim: int, init_std: float, partition: str = "local"):
        super().__init__()
        if partition not in PARTITIONS:
            raise ValueError(f"MemoryTable partition must be one of {PARTITIONS}, got {partition!r}")
        self.num_slots, self.dim, self.partition = num_slots, dim, partition
        self.weight = torch.nn.Parameter(torch.randn(num_slots, dim) * init_std)
        self.weight.memory_value = True
        self.weight.memory_init_std = init_std

    def lookup_reduce(self, indices: torch.Tensor, scores: torch.Tensor, block_ids, num_blocks: int):
        """``[T, K]`` slots, ``[T, K, C]`` scores, ``[T, K]`` virtual blocks or None ->
        ``[T, num_blocks, dim]`` pooled values (UltraMem Eq. 15 and 17; ``rmt.ops`` contract)."""
        return lookup_reduce(self.weight, indices, scores.to(self.weight.dtype), block_ids, num_blocks)
