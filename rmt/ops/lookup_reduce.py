"""Fused lookup-reduce: the memory layer's hot op (UltraMem, arXiv 2411.12364).

Each token t looks up K value rows ``table[indices[t, k]]`` (the top-m retrieved slots) and
sums them weighted by their scores. Two UltraMem refinements shape the contract:

* multi-core scoring (Eq. 16-17): ``scores[t, k, c]`` has C columns; column c weights the c-th
  D/C slice of the row, so the output is the concatenation ``[s^(1)T V^(1), ..., s^(h)T V^(h)]``;
* implicit value expansion, IVE (Eq. 13-15): each lookup belongs to a virtual block
  ``block_ids[t, k]`` in ``[0, num_blocks)``; the op returns one pooled vector per virtual
  block, ``V^T s_p`` of Eq. 15, and the caller applies the per-block projections ``W_p``.

    out[t, b, c*D/C:(c+1)*D/C] = sum_{k : block_ids[t,k] == b} scores[t,k,c] * table[indices[t,k], c*D/C:(c+1)*D/C]

Backends (fastest present first; declared and chosen in :mod:`rmt.ops.dispatch`): CUDA extension
(CUDA tensors) > Triton (CUDA tensors) > C++/OpenMP extension (CPU tensors) > plain torch
reference. Force one with ``backend=`` or the
environment variable ``RMT_LOOKUP_BACKEND`` (``reference|cpu|triton|cuda``; Triton on CPU only
under ``TRITON_INTERPRET=1``). Every backend accumulates in fp32 and computes the table gradient
without atomics: lookups are sorted by row, then each row's contributions are summed in a fixed
order, so the table gradient is bit-identical from run to run.

Dtypes. The table may be stored narrower than the computation, like FBGEMM's table-batched
embeddings with bf16 weights and fp32 outputs:

    ==========================  =================  ====================================
    table                       scores             backends
    ==========================  =================  ====================================
    float32, bfloat16, float16  the table's dtype  cuda, triton, cpu, reference
    bfloat16, float16           float32            cuda, triton, cpu, reference
    float64                     float64            cpu, reference
    ==========================  =================  ====================================

The output, its gradient and the score gradients have the scores' dtype; the table gradient
(dense, or the sparse touched rows) has the table's. Every backend reads the table's stored
values, converts them exactly to fp32 (fp64 for fp64), accumulates there, and rounds each result
once to its dtype: with a bf16 table and fp32 scores the only rounding beyond fp32 arithmetic is
the table's storage and the table gradient's final rounding (each row's gradient is summed in
fp32 and rounded to bf16 once), so the output equals the fp32 computation on the same
(bf16-representable) table values, and the table gradient is the fp32 gradient rounded to bf16
(``check_narrow_table`` in tests/kernel_checks.py, run for every backend). A bf16 table halves the bytes
the op gathers and the gradient rows it writes; its scores should stay fp32.
"""

import torch

from .dispatch import get_backend, select_backend
from .validate import check_inputs, contiguous_as


class LookupReduceFunction(torch.autograd.Function):
    """autograd.Function over one backend's forward/backward kernels.

    The backward returns the table gradient either as a coalesced sparse COO tensor of the
    touched rows (``sparse_grad=True``; no table-sized tensor is created) or as a dense tensor
    (``sparse_grad=False``): the backend's ``backward_dense`` (written in one pass where the
    backend declares that kernel, else the touched rows scattered into a zero tensor).

    A backend that declares ``forward_for_backward`` (CUDA; :mod:`rmt.ops.dispatch`) starts the
    index-only part of its backward (the sort by row) in the forward when a gradient is needed;
    its backward takes the result as ``prep``.
    """

    @staticmethod
    def forward(ctx, table, scores, indices, block_ids, num_blocks, backend, sparse_grad):
        impl = get_backend(backend if indices.numel() else "reference")
        ctx.impl, ctx.num_blocks, ctx.sparse_grad = impl, num_blocks, sparse_grad
        ctx.save_for_backward(table, scores, indices, block_ids)
        if not impl.sorts_in_forward or not any(ctx.needs_input_grad[:2]):
            ctx.prep = {}
            return impl.forward(table, indices, scores, block_ids, num_blocks)
        out, prep = impl.forward_for_backward(table, indices, scores, block_ids, num_blocks)
        ctx.prep = {"prep": prep}
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        table, scores, indices, block_ids = ctx.saved_tensors
        prep, ctx.prep = ctx.prep, {}  # freed with the saved tensors, not with the output's graph
        grad_out = contiguous_as(grad_out, scores.dtype)
        args = (grad_out, table, indices, scores, block_ids, ctx.num_blocks)
        if ctx.needs_input_grad[0] and not ctx.sparse_grad:
            grad_table, grad_scores = ctx.impl.backward_dense(*args, **prep)
        else:
            rows, values, grad_scores = ctx.impl.backward(*args, **prep)
            grad_table = None
            if ctx.needs_input_grad[0]:
                grad_table = torch.sparse_coo_tensor(
                    rows.unsqueeze(0), values, table.shape, is_coalesced=True, check_invariants=False
                )
        if not ctx.needs_input_grad[1]:
            grad_scores = None
        return grad_table, grad_scores, None, None, None, None, None


def lookup_reduce(
    table, indices, scores, block_ids=None, num_blocks=1, *, backend=None, sparse_grad=False, validate=True, update=None
):
    """Gather-and-weighted-sum of memory value rows, grouped by IVE virtual block.

    Args:
        table: [N, D] value table (float32, bfloat16, float16; float64 on reference and cpu).
        indices: [T, K] int32/int64 row indices in [0, N); duplicates within a token are allowed.
        scores: [T, K, C] weights, of the table's dtype or float32 for a bfloat16/float16 table
            (see the module docstring); column c scales the c-th D/C slice (multi-core scores,
            UltraMem Eq. 16-17). D must be divisible by C.
        block_ids: [T, K] int virtual-block ids in [0, num_blocks) (IVE, Eq. 13-15), or None
            for a single block.
        num_blocks: number of virtual blocks E.
        backend: None (auto / $RMT_LOOKUP_BACKEND) or one of "reference", "cpu", "triton", "cuda".
        sparse_grad: return the table gradient as a sparse COO tensor of the touched rows,
            coalesced, of the table's dtype (use with ``rmt.ops.sparse_optim.SparseAdam`` or
            ``RowWiseAdagrad``).
        validate: check index ranges (one min/max reduction each); shape and dtype checks
            always run.
        update: a :class:`rmt.ops.fused_update.FusedValueUpdate` of ``table``: the backward steps
            the touched rows with its optimizer instead of returning a table gradient (when the
            table requires one and grad mode is on; see :mod:`rmt.ops.fused_update`).

    Returns:
        [T, num_blocks, D] tensor of ``scores.dtype`` (accumulated in fp32, fp64 for fp64).
    """
    check_inputs(table, indices, scores, block_ids, num_blocks, check_range=validate)
    name = select_backend(table.device, backend, table.dtype)
    indices = contiguous_as(indices, torch.int64)
    if block_ids is not None:
        block_ids = contiguous_as(block_ids, torch.int64)
    if update is not None and table.requires_grad and torch.is_grad_enabled():
        from .fused_update import LookupReduceUpdateFunction

        if not table.is_contiguous():
            raise ValueError("lookup_reduce: a table stepped in the backward (update=) must be contiguous")
        return LookupReduceUpdateFunction.apply(
            table, scores.contiguous(), indices, block_ids, num_blocks, name, update
        )
    return LookupReduceFunction.apply(
        table.contiguous(), scores.contiguous(), indices, block_ids, num_blocks, name, sparse_grad
    )
