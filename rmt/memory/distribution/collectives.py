"""The collectives of the sharded lookup routes (UltraMem Appendix C and D), with their bytes.

Every collective is an ``all_to_all_single`` with per-rank split sizes, so token counts may
differ between ranks (the counts are exchanged first; no padding row). Gradients run back
along the reverse routes inside autograd Functions. Each rank counts the bytes it sends to
other ranks per collective in a :class:`~rmt.memory.comm_counter.CommCounter` under the
names and conventions of :mod:`rmt.memory.comm_volume`.

Under tensor parallelism the ranks of ``split_group`` hold the same tokens: each routes only
its chunk of them (:func:`tensor_parallel_chunks`) and the pooled chunks are all-gathered.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter

_INT32_MAX = 2**31 - 1


def bytes_to_others(x: torch.Tensor, splits: List[int], rank: int) -> int:
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return row * (sum(splits) - splits[rank])


def exchange(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def index_dtype(limit: int) -> torch.dtype:
    return torch.int32 if limit <= _INT32_MAX else torch.int64


class AllToAll(torch.autograd.Function):
    """All-to-all of rows with split sizes; its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter, names):
        ctx.send, ctx.recv, ctx.group, ctx.counter, ctx.bwd_name = send, recv, group, counter, names[1]
        counter.add("forward", names[0], bytes_to_others(x, send, dist.get_rank(group)))
        return exchange(x, send, recv, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.counter.add("backward", ctx.bwd_name, bytes_to_others(grad, ctx.recv, dist.get_rank(ctx.group)))
        return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None, None


def all_gather(x: torch.Tensor, counts: List[int], group) -> torch.Tensor:
    """Rows of every rank, in rank order (an all-to-all sending ``x`` to everyone)."""
    P = len(counts)
    return exchange(x.repeat((P,) + (1,) * (x.dim() - 1)), [x.shape[0]] * P, counts, group)


class AllGather(torch.autograd.Function):
    """All-gather of ragged rows; its backward is the reduce-scatter of the gradients."""

    @staticmethod
    def forward(ctx, x, counts, group, counter, names):
        ctx.counts, ctx.group, ctx.counter, ctx.bwd_name = counts, group, counter, names[1]
        P, rank = len(counts), dist.get_rank(group)
        counter.add("forward", names[0], bytes_to_others(x, [x.shape[0]] * P, rank))
        return all_gather(x, counts, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        P, rank = len(ctx.counts), dist.get_rank(ctx.group)
        n = ctx.counts[rank]
        ctx.counter.add("backward", ctx.bwd_name, bytes_to_others(grad, ctx.counts, rank))
        parts = exchange(grad, ctx.counts, [n] * P, ctx.group)
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
        ctx.counter.add("backward", "tp_all_gather_score_grads", bytes_to_others(grad, [grad.shape[0]] * P, rank))
        return all_gather(grad, ctx.counts, ctx.group), None, None, None


class _GatherChunks(torch.autograd.Function):
    """All-gather of the chunks' outputs over ``group``; the backward keeps this rank's chunk
    of the gradient (identical on every rank: the consumers are replicated)."""

    @staticmethod
    def forward(ctx, x, counts, group, counter):
        P, rank = len(counts), dist.get_rank(group)
        ctx.start, ctx.n = sum(counts[:rank]), counts[rank]
        counter.add("forward", "tp_all_gather_pooled", bytes_to_others(x, [x.shape[0]] * P, rank))
        return all_gather(x.contiguous(), counts, group)

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
