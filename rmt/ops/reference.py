"""Plain-torch reference of the fused lookup-reduce (UltraMem Eq. 13-17).

``reference_forward`` is differentiable by torch autograd and is the ground truth every
backend is tested against. ``reference_backward`` computes the same (rows, row gradients,
score gradients) triple the kernels return, in plain torch, so the reference can also run
behind the op's ``autograd.Function``.

Dtypes (the op's contract, :mod:`rmt.ops.lookup_reduce`): the table may be narrower than the
scores (a bfloat16/float16 table with float32 scores). Everything is computed in the
accumulation dtype (float64 for float64 scores, else float32) from the table's stored values;
the output and the score gradients take the scores' dtype, the table gradient rows the table's,
each row's gradient summed in the accumulation dtype and rounded once.
"""

import torch

from .row_step import RowStep


def acc_dtype(scores_dtype):
    """The accumulation dtype: float64 for float64 scores (and tables), else float32."""
    return torch.float64 if scores_dtype == torch.float64 else torch.float32


def reference_forward(table, indices, scores, block_ids=None, num_blocks=1):
    """out[t, b, slice c] = sum_{k: block_ids[t,k]==b} scores[t,k,c] * table[indices[t,k], slice c].

    Accumulates in :func:`acc_dtype` and returns ``scores.dtype``. Differentiated by autograd
    with respect to a table narrower than the scores, each lookup's contribution is rounded to
    the table dtype before the per-row sum: the op's table gradient (one rounding per row) is
    :func:`reference_backward`'s, and tests differentiate this function on upcast tables.
    """
    T, K = indices.shape
    D = table.shape[1]
    C = scores.shape[2]
    acc = acc_dtype(scores.dtype)
    rows = table[indices.reshape(-1).long()].to(acc).view(T * K, C, D // C)
    weighted = (rows * scores.reshape(T * K, C, 1).to(acc)).view(T * K, D)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)
    blocks = 0 if block_ids is None else block_ids.reshape(-1).long()
    out = torch.zeros(T * num_blocks, D, dtype=acc, device=table.device)
    out = out.index_add(0, token * num_blocks + blocks, weighted)
    return out.view(T, num_blocks, D).to(scores.dtype)


def reference_backward(grad_out, table, indices, scores, block_ids, num_blocks, grad_dtype=None):
    """Return (unique touched rows [U], their gradient rows [U, D] of ``grad_dtype`` (default
    ``table.dtype``; the fused optimizer update takes them unrounded, in the accumulation dtype),
    score gradients [T, K, C] of ``scores.dtype``); ``grad_out`` has the output's (scores') dtype."""
    T, K = indices.shape
    D = table.shape[1]
    C = scores.shape[2]
    M = T * K
    acc = acc_dtype(scores.dtype)
    flat = indices.reshape(-1).long()
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)
    blocks = 0 if block_ids is None else block_ids.reshape(-1).long()
    g = grad_out.reshape(T * num_blocks, D)[token * num_blocks + blocks].to(acc).view(M, C, D // C)
    s = scores.reshape(M, C, 1).to(acc)
    values = torch.zeros(rows.numel(), D, dtype=acc, device=table.device)
    values.index_add_(0, inverse, (g * s).view(M, D))
    grad_scores = score_gradients(grad_out, table, indices, scores, block_ids, num_blocks)
    return rows, values.to(grad_dtype or table.dtype), grad_scores


def score_gradients(grad_out, table, indices, scores, block_ids, num_blocks):
    """[T, K, C] score gradients alone: ``<table row, output-gradient row>`` per column slice."""
    T, K = indices.shape
    D = table.shape[1]
    C = scores.shape[2]
    acc = acc_dtype(scores.dtype)
    token = torch.arange(T, device=indices.device).repeat_interleave(K)
    blocks = 0 if block_ids is None else block_ids.reshape(-1).long()
    g = grad_out.reshape(T * num_blocks, D)[token * num_blocks + blocks].to(acc).view(T * K, C, D // C)
    rows = table[indices.reshape(-1).long()].to(acc).view(T * K, C, D // C)
    return (rows * g).sum(-1).view(T, K, C).to(scores.dtype)


def reference_backward_update(
    grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update: RowStep
):
    """Plain torch: the reference backward's gradient rows (unrounded), times ``update.grad_scale``,
    stepped (``update``: :class:`~rmt.ops.row_step.RowStep`) by :func:`~rmt.ops.sparse_optim.sparse_adam_update_` or
    :func:`~rmt.ops.sparse_optim.rowwise_adagrad_update_`. Returns (score gradients of tokens
    ``[score_first, score_first + score_tokens)``, squared norm of the scaled gradient)."""
    from .sparse_optim import rowwise_adagrad_update_, sparse_adam_update_

    rows, values, grad_scores = reference_backward(
        grad_out, table, indices, scores, block_ids, num_blocks, grad_dtype=acc_dtype(scores.dtype)
    )
    u = update
    if u.grad_scale != 1.0:
        values = values * u.grad_scale
    sq = float(values.double().pow(2).sum())
    if u.adam:
        sparse_adam_update_(table, u.state1, u.state2, rows, values, u.lr, u.beta1, u.beta2, u.eps, u.step)
    else:
        rowwise_adagrad_update_(table, u.state1, rows, values, u.lr, u.eps, u.weight_decay)
    return grad_scores[score_first : score_first + score_tokens], sq


forward = reference_forward
backward = reference_backward
backward_update = reference_backward_update


def is_available(device):
    """The reference runs on every device."""
    return True
