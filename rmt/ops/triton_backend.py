"""Triton backend: launches rmt/ops/triton_kernels.py; row sort and segmenting in torch.

Runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests), which must
be set before Triton is first imported.
"""

import importlib.util
import os

import torch


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
    out = torch.empty(T, num_blocks, D, dtype=table.dtype, device=table.device)
    has_blocks = block_ids is not None
    lookup_reduce_fwd_kernel[(T, num_blocks)](
        table, indices, scores, block_ids if has_blocks else indices, out, K, D, num_blocks,
        D // C, C=C, HAS_BLOCKS=has_blocks, BLOCK_D=_block_d(D))
    return out


def sort_by_row(indices):
    """Stable sort of flat lookup positions by row: (positions, segment starts [U+1], rows [U])."""
    keys, positions = torch.sort(indices.reshape(-1), stable=True)
    rows, counts = torch.unique_consecutive(keys, return_counts=True)
    seg_start = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=indices.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    return positions, seg_start, rows


def backward(grad_out, table, indices, scores, block_ids, num_blocks):
    from .triton_kernels import lookup_reduce_bwd_kernel

    K = indices.shape[1]
    D = table.shape[1]
    C = scores.shape[2]
    positions, seg_start, rows = sort_by_row(indices)
    values = torch.empty(rows.numel(), D, dtype=table.dtype, device=table.device)
    grad_scores = torch.empty_like(scores)
    has_blocks = block_ids is not None
    lookup_reduce_bwd_kernel[(rows.numel(),)](
        grad_out, table, scores, block_ids if has_blocks else indices, positions, seg_start,
        rows, values, grad_scores, K, D, num_blocks, D // C, C=C, HAS_BLOCKS=has_blocks,
        BLOCK_D=_block_d(D))
    return rows, values, grad_scores
