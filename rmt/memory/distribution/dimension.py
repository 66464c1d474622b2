"""Dimension-wise distribution: the table's columns split in ``P`` slices over the group.

Indices (IVE blocks packed as ``block * N + row``) and scores are all-gathered, every rank pools
its column slice for all tokens of the group and sends each requester its slice (all-to-all):
a rank's ``T`` tokens (``[T, K]`` slots, ``[T, K, C]`` scores, ``[T, K]`` IVE blocks) to its
pooled values ``[T, E, D]`` (UltraMem Appendix D, Eq. 15 and 17).
"""

from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter
from rmt.memory.distribution.collectives import (
    AllGather,
    AllToAll,
    all_gather,
    bytes_to_others,
    index_dtype,
    token_counts,
)
from rmt.memory.distribution.sharded import ShardedDistribution


def _core_columns(col0: int, width: int, dim: int, cores: int) -> List[int]:
    """Score column of each of the equal pieces the ``width``-column slice starting at
    ``col0`` (a multiple of ``width``) splits into so that every piece lies within one core's
    ``dim / cores`` columns (multi-core scoring, Eq. 17)."""
    core_width = dim // cores
    piece = math.gcd(width, core_width)
    return [(col0 + i * piece) // core_width for i in range(width // piece)]


def dimension_lookup(shard, indices, scores, block_ids, num_blocks, num_slots, dim, group, counter: CommCounter):
    """Dimension-wise: all-gather indices and scores, pool the local column slice for every
    token of the group, all-to-all of the pooled slices back (Appendix D)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    C, width, E = scores.shape[-1], shard.shape[1], num_blocks
    counts = token_counts(T, group, indices.device)
    addr = indices.long() if block_ids is None else block_ids.long() * num_slots + indices.long()
    addr = addr.to(index_dtype(E * num_slots))
    counter.add("forward", "all_gather_indices", bytes_to_others(addr, [T] * P, rank))
    every = all_gather(addr, counts, group).long()
    every_scores = AllGather.apply(
        scores.contiguous(), counts, group, counter, ("all_gather_scores", "reduce_scatter_score_grads")
    )
    columns = torch.tensor(_core_columns(rank * width, width, dim, C), device=scores.device)
    pooled = shard.lookup(
        every % num_slots, every_scores.index_select(2, columns), None if block_ids is None else every // num_slots, E
    )
    back = AllToAll.apply(pooled, counts, [T] * P, group, counter, ("all_to_all_pooled", "all_to_all_pooled_grads"))
    return back.view(P, T, E, width).permute(1, 2, 0, 3).reshape(T, E, P * width)


class DimensionDistribution(ShardedDistribution):
    """Columns split over ``group`` (``dim`` divisible by its size). Every rank sees every lookup
    of the group; its slot counters are an equal range of the rows (:meth:`owned`)."""

    name = "dimension"
    axis = 1

    def __init__(self, num_slots: int, dim: int, group, **sharding):
        super().__init__(num_slots, dim, group, **sharding)
        if dim % self.group_size:
            raise ValueError(
                f"dimension-wise MemoryTable: dim ({dim}) must be divisible by the memory-parallel group size "
                f"({self.group_size})"
            )

    @property
    def shard_index(self):
        cols = self.dim // self.group_size
        return slice(None), slice(self.rank * cols, (self.rank + 1) * cols)

    def owned(self, slots: torch.Tensor) -> torch.Tensor:
        first, count = self.owned_rows.start, len(self.owned_rows)
        return slots[(slots >= first) & (slots < first + count)]

    def route(self, shard, indices, scores, block_ids, num_blocks: int):
        return dimension_lookup(
            shard, indices, scores, block_ids, num_blocks, self.num_slots, self.dim, self.group, self.counter
        )
