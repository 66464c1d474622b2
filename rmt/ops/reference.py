"""Plain-torch reference of the fused lookup-reduce (UltraMem Eq. 13-17).

``reference_forward`` is differentiable by torch autograd and is the ground truth every
backend is tested against. ``reference_backward`` computes the same (rows, row gradients,
score gradients) triple the kernels return, in plain torch, so the reference can also run
behind the op's ``autograd.Function``.
"""

import torch


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_forward(table, indices, scores, block_ids=None, num_blocks=1):
    """out[t, b, slice c] = sum_{k: block_ids[t,k]==b} scores[t,k,c] * table[indices[t,k], slice c].

    Accumulates in fp32 (fp64 for fp64 tables) and returns ``table.dtype``.
    """
    T, K = indices.shape
    D = table.shape[1]
    C = scores.shape[2]
    acc = _acc_dtype(table.dtype)
    rows = table[indices.reshape(-1).long()].to(acc).view(T * K, C, D // C)
    weighted = (rows * scores.reshape(T * K, C, 1).to(acc)).view(T * K, D)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)
    blocks = 0 if block_ids is None else block_ids.reshape(-1).long()
    out = torch.zeros(T * num_blocks, D, dtype=acc, device=table.device)
    out = out.index_add(0, token * num_blocks + blocks, weighted)
    return out.view(T, num_blocks, D).to(table.dtype)


def reference_backward(grad_out, table, indices, scores, block_ids, num_blocks):
    """Return (unique touched rows [U], their gradient rows [U, D], score gradients [T, K, C])."""
    T, K = indices.shape
    D = table.shape[1]
    C = scores.shape[2]
    M = T * K
    acc = _acc_dtype(table.dtype)
    flat = indices.reshape(-1).long()
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)
    blocks = 0 if block_ids is None else block_ids.reshape(-1).long()
    g = grad_out.reshape(T * num_blocks, D)[token * num_blocks + blocks].to(acc).view(M, C, D // C)
    s = scores.reshape(M, C, 1).to(acc)
    values = torch.zeros(rows.numel(), D, dtype=acc, device=table.device)
    values.index_add_(0, inverse, (g * s).view(M, D))
    trows = table[flat].to(acc).view(M, C, D // C)
    grad_scores = (trows * g).sum(-1).view(T, K, C)
    return rows, values.to(table.dtype), grad_scores.to(scores.dtype)


forward = reference_forward
backward = reference_backward


def is_available(device):
    """The reference runs on every device."""
    return True
