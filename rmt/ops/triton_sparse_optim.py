"""Triton kernels of the fused row-wise optimizer steps of :mod:`rmt.ops.sparse_optim`, the GPU
counterpart of ``csrc/sparse_optim_cpu.cpp`` (imported only when used; tested on CPU tensors in
the Triton interpreter). One program per touched row: the rows of a coalesced gradient are
unique, so programs own disjoint rows (no atomics). Arithmetic in fp32; any D (masked lanes).
A bf16/fp16 table keeps fp32 state (Adam's moments, Adagrad's per-row sums): the row and its
gradient are loaded as fp32 and only the new row is rounded, once, to the table's dtype on store
(to nearest even on a GPU; the Triton interpreter truncates fp32 -> bf16, see
``round_fp32`` in tests/kernel_checks.py).

The launchers take the same arguments as the C++ extension's functions, so the optimizers call
either through one interface. Like the C++ kernels (and torch's formulation, which the
references in :mod:`rmt.ops.sparse_optim` follow), every product, sum, quotient and square root
is rounded on its own and correctly: no fused multiply-adds (``enable_fp_fusion=False``), IEEE
division and square root (``div_rn``, ``sqrt_rn``; ``tl.sqrt`` is documented as a fast square
root, and ``/`` promises no rounding). So the Adam kernel equals the torch reference bit for bit
wherever torch's square root is correctly rounded (on CUDA; its vectorized CPU one is not).
"""

import math

import triton
import triton.language as tl


@triton.jit
def sparse_adam_kernel(
    param, exp_avg, exp_avg_sq, rows, values, D, one_minus_beta1, one_minus_beta2, eps, step_size, BLOCK_D: tl.constexpr
):
    u = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    off = tl.load(rows + u) * D + d
    g = tl.load(values + u * D + d, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(exp_avg + off, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq + off, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param + off, mask=mask, other=0.0).to(tl.float32)
    m = m + (g - m) * one_minus_beta1
    v = v + (g * g - v) * one_minus_beta2
    p = p - step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps)
    tl.store(exp_avg + off, m.to(exp_avg.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq + off, v.to(exp_avg_sq.dtype.element_ty), mask=mask)
    tl.store(param + off, p.to(param.dtype.element_ty), mask=mask)


@triton.jit
def rowwise_adagrad_kernel(param, state_sum, rows, values, D, lr, eps, weight_decay, BLOCK_D: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    row = tl.load(rows + u)
    p = tl.load(param + row * D + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(values + u * D + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(weight_decay != 0.0, g + weight_decay * p, g)  # no term at 0 (row_optim.h, NoDecay)
    s = tl.load(state_sum + row) + tl.div_rn(tl.sum(g * g, axis=0), D * 1.0)
    tl.store(state_sum + row, s)
    p = p - tl.div_rn(lr, tl.sqrt_rn(s) + eps) * g
    tl.store(param + row * D + d, p.to(param.dtype.element_ty), mask=mask)


def _block_d(D):
    return max(16, 1 << (D - 1).bit_length())


def sparse_adam_step(param, exp_avg, exp_avg_sq, rows, values, lr, beta1, beta2, eps, step):
    """In place on the unique ``rows``: torch.optim.SparseAdam's update (see the C++ kernel)."""
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    D = param.shape[1]
    sparse_adam_kernel[(rows.numel(),)](
        param,
        exp_avg,
        exp_avg_sq,
        rows,
        values,
        D,
        1 - beta1,
        1 - beta2,
        eps,
        step_size,
        BLOCK_D=_block_d(D),
        enable_fp_fusion=False,
    )


def rowwise_adagrad_step(param, state_sum, rows, values, lr, eps, weight_decay):
    """In place on the unique ``rows``: s += mean(g^2); p -= lr * g / (sqrt(s) + eps)."""
    D = param.shape[1]
    rowwise_adagrad_kernel[(rows.numel(),)](
        param, state_sum, rows, values, D, lr, eps, weight_decay, BLOCK_D=_block_d(D), enable_fp_fusion=False
    )
