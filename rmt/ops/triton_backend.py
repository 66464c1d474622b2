"""Triton backend: launches rmt/ops/triton_kernels.py; row sort and segmenting in torch.

Runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests), which must
be set before Triton is first imported. The output and score gradients take the scores' dtype,
the table gradient the table's (a bf16/fp16 table may come with fp32 scores): the kernels load
every operand as fp32 and round each result once on store.
"""

import importlib.util
import os

import torch

from .row_step import RowStep


def is_available(device):
    """CUDA tensors with Triton installed; CPU tensors only in the Triton interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _block_d(D):
    return max(16, 1 << (D - 1).bit_length())


def forward(table, indices, scores, block_ids, num_blocks):
    from .triton_kernels import lookup_reduce_fwd_kernel

    T, K = indices.shape
    N, D = table.shape
    C = scores.shape[2]
    out = torch.empty(T, num_blocks, D, dtype=scores.dtype, device=table.device)
    has_blocks = block_ids is not None
    lookup_reduce_fwd_kernel[(T, num_blocks)](
        table,
        indices,
        scores,
        block_ids if has_blocks else indices,
        out,
        K,
        D,
        num_blocks,
        D // C,
        C=C,
        HAS_BLOCKS=has_blocks,
        BLOCK_D=_block_d(D),
    )
    return out


def sort_by_row(indices):
    """Stable sort of the flat lookups by row, segmented on the device without a host sync:
    (positions [M], rows [M], segment starts [M + 1], U as a [1] tensor). Segment u < U is the
    unique row ``rows[u]`` with lookups ``positions[seg_start[u]:seg_start[u + 1]]``; past U,
    ``rows`` is 0 and ``seg_start`` is M."""
    flat = indices.reshape(-1)
    keys, positions = torch.sort(flat, stable=True)
    head = torch.ones_like(keys, dtype=torch.bool)
    torch.ne(keys[1:], keys[:-1], out=head[1:])
    segment = torch.cumsum(head, 0) - 1
    rows = torch.zeros_like(keys).scatter_(0, segment, keys)  # a segment's lookups write one value
    seg_start = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=flat.device)
    seg_start.index_add_(0, segment + 1, torch.ones_like(segment))  # integer counts: exact
    return positions, rows, seg_start.cumsum_(0), segment[-1:] + 1


def _launch_backward(grad_out, table, indices, scores, block_ids, num_blocks, dst, dense):
    from .triton_kernels import lookup_reduce_bwd_kernel

    K = indices.shape[1]
    D = table.shape[1]
    C = scores.shape[2]
    positions, rows, seg_start, num_unique = sort_by_row(indices)
    grad_scores = torch.empty_like(scores)
    has_blocks = block_ids is not None
    lookup_reduce_bwd_kernel[(indices.numel(),)](
        grad_out,
        table,
        scores,
        block_ids if has_blocks else indices,
        positions,
        seg_start,
        rows,
        num_unique,
        dst,
        grad_scores,
        K,
        D,
        num_blocks,
        D // C,
        C=C,
        HAS_BLOCKS=has_blocks,
        DENSE=dense,
        BLOCK_D=_block_d(D),
    )
    return rows, num_unique, grad_scores


def backward(grad_out, table, indices, scores, block_ids, num_blocks):
    """(unique rows [U], their gradient rows [U, D], score gradients): U is read once, after
    the kernel is queued."""
    values = torch.empty(indices.numel(), table.shape[1], dtype=table.dtype, device=table.device)
    rows, num_unique, grad_scores = _launch_backward(
        grad_out, table, indices, scores, block_ids, num_blocks, values, False
    )
    count = int(num_unique)
    return rows[:count], values[:count], grad_scores


def backward_dense(grad_out, table, indices, scores, block_ids, num_blocks):
    """(dense [N, D] table gradient, score gradients), with no host sync."""
    grad_table = torch.zeros_like(table)
    _, _, grad_scores = _launch_backward(grad_out, table, indices, scores, block_ids, num_blocks, grad_table, True)
    return grad_table, grad_scores


def score_gradients(grad_out, table, indices, scores, block_ids, num_blocks):
    """[T, K, C] score gradients alone: the torch formulation (a gather of the looked-up rows)."""
    from .reference import score_gradients as torch_score_gradients

    return torch_score_gradients(grad_out, table, indices, scores, block_ids, num_blocks)


def backward_update(
    grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update: RowStep
):
    """The backward with the optimizer step fused in (:mod:`rmt.ops.fused_update`): one program
    per unique row sums its gradient, computes its lookups' score gradients and steps the row and
    its state in place; no gradient row is stored. Returns (score gradients of tokens
    ``[score_first, score_first + score_tokens)``, squared norm of the scaled gradient, a device
    scalar: no host sync)."""
    from .triton_kernels import lookup_reduce_bwd_update_kernel

    K = indices.shape[1]
    D = table.shape[1]
    C = scores.shape[2]
    M = indices.numel()
    positions, rows, seg_start, num_unique = sort_by_row(indices)
    grad_scores = torch.empty(score_tokens, K, C, dtype=scores.dtype, device=scores.device)
    row_sq = torch.zeros(M, dtype=torch.float32, device=table.device)
    u = update
    has_blocks = block_ids is not None
    if M:
        lookup_reduce_bwd_update_kernel[(M,)](
            grad_out,
            table,
            scores,
            block_ids if has_blocks else indices,
            positions,
            seg_start,
            rows,
            num_unique,
            grad_scores,
            score_first * K,
            (score_first + score_tokens) * K,
            u.state1,
            u.state2 if u.state2 is not None else u.state1,
            row_sq,
            K,
            D,
            num_blocks,
            D // C,
            u.grad_scale,
            u.rate,  # Adam's bias-corrected step size, as in the unfused step
            1 - u.beta1,
            1 - u.beta2,
            u.eps,
            u.weight_decay,
            C=C,
            HAS_BLOCKS=has_blocks,
            ADAM=u.adam,
            BLOCK_D=_block_d(D),
            enable_fp_fusion=False,
        )
    return grad_scores, row_sq.double().sum()
