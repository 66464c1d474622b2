"""Local distribution: the whole table on every rank, looked up in place."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rmt.memory.comm_counter import CommCounter


def union_count(flags: torch.Tensor, group, device, chunk: int) -> torch.Tensor:
    """How many of the slot ``flags`` (uint8) are set on any rank of ``group``: their maximum
    over the group, ``chunk`` flags at a time on ``device`` (a copy: the flags stay as they are)."""
    count = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, flags.numel(), max(chunk, 1)):
        part = flags[start : start + chunk].to(device, copy=True)
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        count += part.sum(dtype=torch.int64)
    return count


class LocalDistribution:
    """``num_slots x dim`` whole on this rank: no group, no replicas, no collective in a lookup."""

    name = "local"
    group = replica_group = split_group = None
    group_size, rank, replica_index = 1, 0, 0

    def __init__(self, num_slots: int, dim: int, counter: CommCounter = None):
        self.num_slots, self.dim = num_slots, dim
        self.counter = counter if counter is not None else CommCounter()

    @property
    def shard_shape(self):
        return self.num_slots, self.dim

    @property
    def shard_index(self):
        return slice(None), slice(None)

    @property
    def owned_rows(self) -> range:
        return range(self.num_slots)

    def owned(self, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def lookup(self, shard, indices, scores, block_ids, num_blocks: int, validate: bool):
        return shard.lookup(indices, scores, block_ids, num_blocks, validate=validate)

    def hit_count(self, hits: torch.Tensor, group, device, chunk: int):
        """``(count, total)``: the union of the slot flags over ``group`` (e.g. the data-parallel
        ranks), a 1-byte-per-slot maximum (the table being whole on every rank anyway)."""
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            count = union_count(hits, group, device, chunk)
        else:
            count = hits.sum(dtype=torch.int64)
        return count, self.num_slots

    def stat_groups(self, group) -> List:
        return [group]

    def sharded_state_dict(self, weight: torch.Tensor, prefix: str, sharded_offsets=()):
        """The weight, replicated."""
        return make_sharded_tensors_for_checkpoint({"weight": weight}, prefix, {}, sharded_offsets)
