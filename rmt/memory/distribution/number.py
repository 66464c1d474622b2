"""Number-wise distribution: the table's rows split in ``P`` equal ranges over the group.

Plain
    every distinct row a rank needs is requested once from its owner (all-to-all of local row
    indices), the owner gathers the rows and sends them back (all-to-all of rows), the requester
    pools them with its scores and block ids.
With ``owner_reduce``
    the scores travel with the indices and the owner pools: each lookup is sent as one packed
    address ``(token * E + block) * rows_per_rank + local_row`` (so no block-id or token-id
    tensor is sent), the owner scatters its weighted rows into a dense partial sum
    ``[T_q, E, D]`` per requester ``q`` and sends it back; the requester sums the ``P``
    partials. Cheaper than plain number-wise whenever top-m exceeds the group size.

Both route a rank's ``T`` tokens (``[T, K]`` slots, ``[T, K, C]`` scores, ``[T, K]`` IVE blocks)
to its pooled values ``[T, E, D]`` (Eq. 15 and 17).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter
from rmt.memory.distribution.collectives import AllToAll, bytes_to_others, exchange, index_dtype, token_counts
from rmt.memory.distribution.sharded import ShardedDistribution
from rmt.ops import lookup_reduce


def _route_to_owners(indices: torch.Tensor, rows_per: int, P: int, group):
    """Sort the lookups by owner: (order, owner-sorted local rows, send and receive splits)."""
    flat = indices.reshape(-1).long()
    owner = torch.div(flat, rows_per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return order, flat[order] - owner[order] * rows_per, send.tolist(), recv.tolist()


def number_lookup(shard, indices, scores, block_ids, num_blocks, group, counter: CommCounter):
    """Plain number-wise: every distinct row travels once to the requester, which pools
    (Appendix D with index dedup: ``rmt.memory.comm_volume``'s ``dedup`` counts exactly this; the
    row gradients of duplicates are summed by the local lookup-reduce before they go back).
    ``shard`` (every route): this rank's rows, read through its ``gather`` and ``lookup``
    (a storage of :mod:`rmt.memory.storage`, which carries the sparse gradient or the fused
    update of the table and marks the rows it serves)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    rows_per = shard.shape[0]
    unique, inverse = torch.unique(indices.reshape(-1).long(), sorted=True, return_inverse=True)
    owner = torch.div(unique, rows_per, rounding_mode="floor")  # ascending: already grouped by owner
    send = torch.bincount(owner, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    local_rows = (unique - owner * rows_per).to(index_dtype(rows_per))
    counter.add("forward", "all_to_all_indices", bytes_to_others(local_rows, send, rank))
    wanted = exchange(local_rows, send, recv, group).long()
    served = shard.gather(wanted)
    rows = AllToAll.apply(served, recv, send, group, counter, ("all_to_all_values", "all_to_all_value_grads"))
    return lookup_reduce(rows, inverse.view(T, K), scores, block_ids, num_blocks, validate=False)


def number_owner_reduce_lookup(shard, indices, scores, block_ids, num_blocks, group, counter: CommCounter):
    """Number-wise with owner-side pooling: partial sums travel back (Appendix D)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    C, D, E, rows_per = scores.shape[-1], shard.shape[1], num_blocks, shard.shape[0]
    counts = token_counts(T, group, indices.device)
    order, local_rows, send, recv = _route_to_owners(indices, rows_per, P, group)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)[order]
    block = 0 if block_ids is None else block_ids.reshape(-1)[order].long()
    addr = ((token * E + block) * rows_per + local_rows).to(index_dtype(max(counts) * E * rows_per))
    counter.add("forward", "all_to_all_indices", bytes_to_others(addr, send, rank))
    got = exchange(addr, send, recv, group).long()
    got_scores = AllToAll.apply(
        scores.reshape(T * K, C)[order], send, recv, group, counter, ("all_to_all_scores", "all_to_all_score_grads")
    )
    M = got.shape[0]
    source = torch.repeat_interleave(torch.arange(P, device=got.device), torch.tensor(recv, device=got.device))
    first_token = torch.tensor([0] + counts[:-1], device=got.device).cumsum(0)
    target = first_token[source] * E + torch.div(got, rows_per, rounding_mode="floor")
    weighted = shard.lookup((got % rows_per).view(M, 1), got_scores.view(M, 1, C)).view(M, D)
    partial = weighted.new_zeros(sum(counts) * E, D).index_add(0, target, weighted)
    back = AllToAll.apply(
        partial.view(sum(counts), E, D),
        counts,
        [T] * P,
        group,
        counter,
        ("all_to_all_partial_sums", "all_to_all_partial_sum_grads"),
    )
    return back.view(P, T, E, D).sum(0)


class NumberDistribution(ShardedDistribution):
    """Rows split over ``group`` (``num_slots`` divisible by its size); ``owner_reduce``: the
    owners pool (module docstring)."""

    name = "number"
    axis = 0

    def __init__(self, num_slots: int, dim: int, group, owner_reduce: bool = False, **sharding):
        super().__init__(num_slots, dim, group, **sharding)
        if num_slots % self.group_size:
            raise ValueError(
                f"number-wise MemoryTable: num_slots ({num_slots}) must be divisible by "
                f"the memory-parallel group size ({self.group_size})"
            )
        self.owner_reduce = owner_reduce

    @property
    def shard_index(self):
        rows = self.num_slots // self.group_size
        return slice(self.rank * rows, (self.rank + 1) * rows), slice(None)

    def route(self, shard, indices, scores, block_ids, num_blocks: int):
        lookup = number_owner_reduce_lookup if self.owner_reduce else number_lookup
        return lookup(shard, indices, scores, block_ids, num_blocks, self.group, self.counter)
