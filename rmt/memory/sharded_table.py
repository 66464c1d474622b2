"""Sharded lookup-reduce over a memory-parallel group (UltraMem Appendix C and D).

Three collective routes from a rank's ``T`` tokens (``[T, K]`` slots, ``[T, K, C]`` scores,
``[T, K]`` IVE blocks) to its pooled values ``[T, E, D]`` (Eq. 15 and 17):

``number``
    the table's rows are split in ``P`` equal ranges. Every distinct row a rank needs is
    requested once from its owner (all-to-all of local row indices), the owner gathers the
    rows and sends them back (all-to-all of rows), the requester pools them with its scores
    and block ids.
``number`` with ``owner_reduce``
    the scores travel with the indices and the owner pools: each lookup is sent as one
    packed address ``(token * E + block) * rows_per_rank + local_row`` (so no block-id or
    token-id tensor is sent), the owner scatters its weighted rows into a dense partial sum
    ``[T_q, E, D]`` per requester ``q`` and sends it back; the requester sums the ``P``
    partials. Cheaper than plain number-wise whenever top-m exceeds the group size.
``dimension``
    the table's columns are split in ``P`` slices. Indices (IVE blocks packed as
    ``block * N + row``) and scores are all-gathered, every rank pools its column slice
    for all tokens of the group and sends each requester its slice (all-to-all).

Under tensor parallelism the ranks of ``split_group`` hold the same tokens: each routes only
its chunk of them (:func:`tensor_parallel_chunks`) and the pooled chunks are all-gathered.

Every collective is an ``all_to_all_single`` with per-rank split sizes, so token counts may
differ between ranks (the counts are exchanged first; no padding row). Gradients run back
along the reverse routes inside autograd Functions. Each rank counts the bytes it sends to
other ranks per collective in a :class:`~rmt.memory.comm_counter.CommCounter` under the
names and conventions of :mod:`rmt.memory.comm_volume`.
"""

from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter
from rmt.ops import lookup_reduce

_INT32_MAX = 2**31 - 1


def _bytes_to_others(x: torch.Tensor, splits: List[int], rank: int) -> int:
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return row * (sum(splits) - splits[rank])


def _exchange(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _index_dtype(limit: int) -> torch.dtype:
    return torch.int32 if limit <= _INT32_MAX else torch.int64


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with split sizes; its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter, names):
        ctx.send, ctx.recv, ctx.group, ctx.counter, ctx.bwd_name = send, recv, group, counter, names[1]
        counter.add("forward", names[0], _bytes_to_others(x, send, dist.get_rank(group)))
        return _exchange(x, send, recv, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.counter.add("backward", ctx.bwd_name, _bytes_to_others(grad, ctx.recv, dist.get_rank(ctx.group)))
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None, None


def _all_gather(x: torch.Tensor, counts: List[int], group) -> torch.Tensor:
    """Rows of every rank, in rank order (an all-to-all sending ``x`` to everyone)."""
    P = len(counts)
    return _exchange(x.repeat((P,) + (1,) * (x.dim() - 1)), [x.shape[0]] * P, counts, group)


class _AllGather(torch.autograd.Function):
    """All-gather of ragged rows; its backward is the reduce-scatter of the gradients."""

    @staticmethod
    def forward(ctx, x, counts, group, counter, names):
        ctx.counts, ctx.group, ctx.counter, ctx.bwd_name = counts, group, counter, names[1]
        P, rank = len(counts), dist.get_rank(group)
        counter.add("forward", names[0], _bytes_to_others(x, [x.shape[0]] * P, rank))
        return _all_gather(x, counts, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        P, rank = len(ctx.counts), dist.get_rank(ctx.group)
        n = ctx.counts[rank]
        ctx.counter.add("backward", ctx.bwd_name, _bytes_to_others(grad, ctx.counts, rank))
        parts = _exchange(grad, ctx.counts, [n] * P, ctx.group)
        return parts.view((P, n) + tuple(grad.shape[1:])).sum(0), None, None, None, None


class _TokenChunk(torch.autograd.Function):
    """This rank's chunk of rows replicated over ``group``; the backward all-gathers the
    chunks' gradients, so every rank holds the full gradient of the replicated input."""

    @staticmethod
    def forward(ctx, x, counts, group, counter):
        rank = dist.get_rank(group)
        ctx.counts, ctx.group, ctx.counter = counts, group, counter
        start = sum(counts[:rank])
        return x[start : start + counts[rank]].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        P, rank = len(ctx.counts), dist.get_rank(ctx.group)
        ctx.counter.add("backward", "tp_all_gather_score_grads", _bytes_to_others(grad, [grad.shape[0]] * P, rank))
        return _all_gather(grad, ctx.counts, ctx.group), None, None, None


class _GatherChunks(torch.autograd.Function):
    """All-gather of the chunks' outputs over ``group``; the backward keeps this rank's chunk
    of the gradient (identical on every rank: the consumers are replicated)."""

    @staticmethod
    def forward(ctx, x, counts, group, counter):
        P, rank = len(counts), dist.get_rank(group)
        ctx.start, ctx.n = sum(counts[:rank]), counts[rank]
        counter.add("forward", "tp_all_gather_pooled", _bytes_to_others(x, [x.shape[0]] * P, rank))
        return _all_gather(x.contiguous(), counts, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.n], None, None, None


def tensor_parallel_chunks(lookup, indices, scores, block_ids, num_blocks, group, counter: CommCounter):
    """``lookup(indices, scores, block_ids, num_blocks)`` on this rank's chunk of the tokens
    that every rank of ``group`` holds (chunks of ``T // P`` or one more), then the pooled
    chunks all-gathered: each lookup is made once per group instead of once per rank."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T = indices.shape[0]
    counts = [T // P + (r < T % P) for r in range(P)]
    part = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    out = lookup(
        indices[part],
        _TokenChunk.apply(scores, counts, group, counter),
        None if block_ids is None else block_ids[part],
        num_blocks,
    )
    return _GatherChunks.apply(out, counts, group, counter)


def token_counts(T: int, group, device) -> List[int]:
    """Tokens of every rank of ``group`` (metadata, not counted)."""
    mine = torch.tensor([T], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(c) for c in every]


def _route_to_owners(indices: torch.Tensor, rows_per: int, P: int, group):
    """Sort the lookups by owner: (order, owner-sorted local rows, send and receive splits)."""
    flat = indices.reshape(-1).long()
    owner = torch.div(flat, rows_per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return order, flat[order] - owner[order] * rows_per, send.tolist(), recv.tolist()


def number_lookup(shard, indices, scores, block_ids, num_blocks, group, counter: CommCounter, record=None):
    """Plain number-wise: every distinct row travels once to the requester, which pools
    (Appendix D with index dedup: ``rmt.memory.comm_volume``'s ``dedup`` counts exactly this; the
    row gradients of duplicates are summed by the local lookup-reduce before they go back).
    ``shard`` (every route): this rank's rows, read through its ``gather`` and ``lookup``
    (:class:`rmt.memory.table.DeviceRows`, or :class:`rmt.memory.host_table.HostTable` for a
    shard in host memory), which carry the sparse gradient or the fused update of the table.
    ``record`` (training statistics) receives the global slots the owner serves, as in every
    route below."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    rows_per = shard.shape[0]
    unique, inverse = torch.unique(indices.reshape(-1).long(), sorted=True, return_inverse=True)
    owner = torch.div(unique, rows_per, rounding_mode="floor")  # ascending: already grouped by owner
    send = torch.bincount(owner, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    local_rows = (unique - owner * rows_per).to(_index_dtype(rows_per))
    counter.add("forward", "all_to_all_indices", _bytes_to_others(local_rows, send, rank))
    wanted = _exchange(local_rows, send, recv, group).long()
    if record is not None:
        record(wanted + rank * rows_per)
    served = shard.gather(wanted)
    rows = _AllToAll.apply(served, recv, send, group, counter, ("all_to_all_values", "all_to_all_value_grads"))
    return lookup_reduce(rows, inverse.view(T, K), scores, block_ids, num_blocks, validate=False)


def number_owner_reduce_lookup(shard, indices, scores, block_ids, num_blocks, group, counter: CommCounter, record=None):
    """Number-wise with owner-side pooling: partial sums travel back (Appendix D)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    C, D, E, rows_per = scores.shape[-1], shard.shape[1], num_blocks, shard.shape[0]
    counts = token_counts(T, group, indices.device)
    order, local_rows, send, recv = _route_to_owners(indices, rows_per, P, group)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)[order]
    block = 0 if block_ids is None else block_ids.reshape(-1)[order].long()
    addr = ((token * E + block) * rows_per + local_rows).to(_index_dtype(max(counts) * E * rows_per))
    counter.add("forward", "all_to_all_indices", _bytes_to_others(addr, send, rank))
    got = _exchange(addr, send, recv, group).long()
    got_scores = _AllToAll.apply(
        scores.reshape(T * K, C)[order], send, recv, group, counter, ("all_to_all_scores", "all_to_all_score_grads")
    )
    M = got.shape[0]
    source = torch.repeat_interleave(torch.arange(P, device=got.device), torch.tensor(recv, device=got.device))
    first_token = torch.tensor([0] + counts[:-1], device=got.device).cumsum(0)
    target = first_token[source] * E + torch.div(got, rows_per, rounding_mode="floor")
    if record is not None:
        record(got % rows_per + rank * rows_per)
    weighted = shard.lookup((got % rows_per).view(M, 1), got_scores.view(M, 1, C)).view(M, D)
    partial = weighted.new_zeros(sum(counts) * E, D).index_add(0, target, weighted)
    back = _AllToAll.apply(
        partial.view(sum(counts), E, D),
        counts,
        [T] * P,
        group,
        counter,
        ("all_to_all_partial_sums", "all_to_all_partial_sum_grads"),
    )
    return back.view(P, T, E, D).sum(0)


def _core_columns(col0: int, width: int, dim: int, cores: int) -> List[int]:
    """Score column of each of the equal pieces the ``width``-column slice starting at
    ``col0`` (a multiple of ``width``) splits into so that every piece lies within one core's
    ``dim / cores`` columns (multi-core scoring, Eq. 17)."""
    core_width = dim // cores
    piece = math.gcd(width, core_width)
    return [(col0 + i * piece) // core_width for i in range(width // piece)]


def dimension_lookup(
    shard, indices, scores, block_ids, num_blocks, num_slots, dim, group, counter: CommCounter, record=None
):
    """Dimension-wise: all-gather indices and scores, pool the local column slice for every
    token of the group, all-to-all of the pooled slices back (Appendix D)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    T, K = indices.shape
    C, width, E = scores.shape[-1], shard.shape[1], num_blocks
    counts = token_counts(T, group, indices.device)
    addr = indices.long() if block_ids is None else block_ids.long() * num_slots + indices.long()
    addr = addr.to(_index_dtype(E * num_slots))
    counter.add("forward", "all_gather_indices", _bytes_to_others(addr, [T] * P, rank))
    every = _all_gather(addr, counts, group).long()
    if record is not None:
        record(every % num_slots)
    every_scores = _AllGather.apply(
        scores.contiguous(), counts, group, counter, ("all_gather_scores", "reduce_scatter_score_grads")
    )
    columns = torch.tensor(_core_columns(rank * width, width, dim, C), device=scores.device)
    pooled = shard.lookup(
        every % num_slots, every_scores.index_select(2, columns), None if block_ids is None else every // num_slots, E
    )
    back = _AllToAll.apply(pooled, counts, [T] * P, group, counter, ("all_to_all_pooled", "all_to_all_pooled_grads"))
    return back.view(P, T, E, width).permute(1, 2, 0, 3).reshape(T, E, P * width)
