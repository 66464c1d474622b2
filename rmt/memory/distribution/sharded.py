"""What the number-wise and dimension-wise distributions share: a table sharded over a
memory-parallel group, its replicas, the tensor-parallel split of the tokens, the slot counters'
sums and the checkpoint's shard."""

from __future__ import annotations

from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from rmt.memory.comm_counter import CommCounter
from rmt.memory.distribution.collectives import tensor_parallel_chunks


class ShardedDistribution:
    """``num_slots x dim`` split over ``group`` along ``axis`` (0: rows, 1: columns).

    ``replica_index`` numbers this group among the groups holding copies of the same table
    (checkpoint replica id); ``replica_group`` joins this rank with the ranks holding the same
    shard in those copies. ``split_group`` (under tensor parallelism): the ranks holding the same
    tokens; each looks up its chunk of them and the pooled outputs are all-gathered. ``counter``
    counts the bytes sent per collective. Subclasses give ``shard_index`` and ``route``."""

    name = ""
    axis = 0

    def __init__(
        self,
        num_slots: int,
        dim: int,
        group,
        *,
        replica_index: int = 0,
        replica_group=None,
        split_group=None,
        counter: Optional[CommCounter] = None,
    ):
        self.num_slots, self.dim, self.group = num_slots, dim, group
        self.group_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.replica_index, self.replica_group, self.split_group = replica_index, replica_group, split_group
        self.counter = counter if counter is not None else CommCounter()

    @property
    def shard_shape(self):
        rows, cols = self.shard_index
        return (
            (rows.stop - rows.start) if rows.start is not None else self.num_slots,
            (cols.stop - cols.start) if cols.start is not None else self.dim,
        )

    @property
    def owned_rows(self) -> range:
        """The slots whose counters this rank keeps: whole rows of a number-wise shard, an equal
        range of the rows of a dimension-wise one (its ranks see every lookup of the group)."""
        per = -(-self.num_slots // self.group_size)
        return range(min(self.rank * per, self.num_slots), min((self.rank + 1) * per, self.num_slots))

    def owned(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots among ``slots`` (global) whose counters this rank keeps."""
        return slots

    def lookup(self, shard, indices, scores, block_ids, num_blocks: int, validate: bool):
        """The pooled values of this rank's tokens through the group's collectives (the routes
        index with slots they derive: ``validate`` is for the local table)."""
        if self.split_group is not None:
            route = partial(self.route, shard)
            return tensor_parallel_chunks(route, indices, scores, block_ids, num_blocks, self.split_group, self.counter)
        return self.route(shard, indices, scores, block_ids, num_blocks)

    def hit_count(self, hits: torch.Tensor, group, device, chunk: int):
        """``(count, total)`` of the slot counters: the owners' counts summed over the group and
        its replicas, against the slots of every replica."""
        count = hits.sum(dtype=torch.int64).reshape(1).to(device)
        dist.all_reduce(count, group=self.group)
        replicas = 1
        if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(count, group=self.replica_group)
            replicas = dist.get_world_size(self.replica_group)
        return count, self.num_slots * replicas

    def stat_groups(self, group) -> List:
        """The groups a scalar count of the table's lookups is summed over: the owners' group and
        its replicas."""
        return [self.group, self.replica_group]

    def sharded_state_dict(self, weight: torch.Tensor, prefix: str, sharded_offsets=()):
        """The weight as this rank's shard of the global ``[num_slots, dim]`` tensor, so
        checkpoints (and AdamW moments) reshard to any group size."""
        return {
            f"{prefix}weight": ShardedTensor.from_rank_offsets(
                f"{prefix}weight",
                weight,
                *sharded_offsets,
                (self.axis + len(sharded_offsets), self.rank, self.group_size),
                replica_id=self.replica_index,
                prepend_axis_num=len(sharded_offsets),
            )
        }
