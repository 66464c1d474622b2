"""CUDA backend: csrc/lookup_reduce_cuda_kernels.cu + its torch binding (built by
:mod:`rmt.ops.extensions`).

A forward that will be differentiated (:func:`forward_for_backward`) also issues the backward's
sort of the lookups by row, on a side stream beside the forward kernel; the backward then reads
the unique-row count without draining the device queue and is a single kernel (see
csrc/lookup_reduce_cuda.cpp).
"""

import torch

from .extensions import load_extension
from .row_step import RowStep

NAME = "rmt_lookup_reduce_cuda"


def _ext():
    return load_extension(NAME)


def is_available(device):
    """True for CUDA tensors when torch has CUDA and the extension builds."""
    return device.type == "cuda" and torch.cuda.is_available() and _ext() is not None


def forward(table, indices, scores, block_ids, num_blocks):
    return _ext().forward(table, indices, scores, block_ids, num_blocks, False)[0]


def forward_for_backward(table, indices, scores, block_ids, num_blocks):
    """(output, the backward's ``SortedLookups``, being computed on a side stream)."""
    return _ext().forward(table, indices, scores, block_ids, num_blocks, True)


def sort(table, indices):
    """The lookups sorted by row, on the current stream (``SortedLookups``)."""
    return _ext().sort(indices, table.shape[0])


def backward(grad_out, table, indices, scores, block_ids, num_blocks, prep=None):
    """(unique rows [U], their gradient rows [U, D], score gradients)."""
    prep = sort(table, indices) if prep is None else prep
    count = prep.count()
    values = torch.empty(count, table.shape[1], dtype=table.dtype, device=table.device)
    grad_scores = torch.empty_like(scores)
    _ext().backward(
        grad_out, table, scores, block_ids, num_blocks, indices.shape[1], prep, count, values, False, grad_scores
    )
    return prep.unique_rows[:count], values, grad_scores


def backward_dense(grad_out, table, indices, scores, block_ids, num_blocks, prep=None):
    """(dense [N, D] table gradient, score gradients): touched rows written in place, and no host
    wait at all (the launch covers M >= U rows; groups past U exit)."""
    prep = sort(table, indices) if prep is None else prep
    grad_table = torch.zeros_like(table)
    grad_scores = torch.empty_like(scores)
    _ext().backward(
        grad_out,
        table,
        scores,
        block_ids,
        num_blocks,
        indices.shape[1],
        prep,
        indices.numel(),
        grad_table,
        True,
        grad_scores,
    )
    return grad_table, grad_scores


def score_gradients(grad_out, table, indices, scores, block_ids, num_blocks):
    """[T, K, C] score gradients alone: the torch formulation (a gather of the looked-up rows)."""
    from .reference import score_gradients as torch_score_gradients

    return torch_score_gradients(grad_out, table, indices, scores, block_ids, num_blocks)


def backward_update(
    grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update: RowStep
):
    """The backward with the optimizer step fused in (:mod:`rmt.ops.fused_update`), no host
    sync: (score gradients of tokens ``[score_first, score_first + score_tokens)``, squared norm of
    the scaled gradient as a device scalar). Rows wider than 512 go to the Triton kernel."""
    K, C, M = indices.shape[1], scores.shape[2], indices.numel()
    u = update
    prep = sort(table, indices)
    grad_scores = torch.empty(score_tokens, K, C, dtype=scores.dtype, device=scores.device)
    row_sq = torch.zeros(M, dtype=torch.float32, device=table.device)
    if not _ext().backward_update(
        grad_out,
        table,
        scores,
        block_ids,
        num_blocks,
        K,
        prep,
        M,
        grad_scores,
        score_first * K,
        (score_first + score_tokens) * K,
        u.adam,
        u.state1,
        u.state2,
        row_sq,
        u.grad_scale,
        u.rate,
        u.beta1,
        u.beta2,
        u.eps,
        u.weight_decay,
    ):
        from . import triton_backend

        return triton_backend.backward_update(
            grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update
        )
    return grad_scores, row_sq.double().sum()
