"""The RMT's write (Mak & Flanigan Eq. 12 without the norm): n data vectors stored in a token's
Dv x Dk residual matrix with n key vectors,

    out[j, k] = sum_h data[j, h] keys[k, h]

for ``data [..., n]`` (rows j = a token's Dv entries), ``keys [Dk, n]``, ``out [..., Dk]``: a linear
layer with n inputs. With a ``residual`` of out's shape, ``residual + out`` (Eq. 15-16's residual
add): the kernel adds it as it stores each row, so the written matrix does not go to memory and
come back for a separate addition (the same bits: every sum rounded, then the addition rounded).
The reference is ``F.linear``; the CPU kernel of ``csrc/matrix_write_cpu.cpp`` computes the same
products with register tiles and a key-major GEMM, where MKL's sgemm is slow on the backward of
these shapes (n = R, 4 in the tiny RMT), for float32 with Dk 16 or 32, data token-major
(contiguous) or key-major (the transpose of a contiguous tensor: the attention's output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("cpu", "torch")


class FusedMatrixWrite(torch.autograd.Function):
    """The CPU kernel: ``apply(data [M, n], keys [Dk, n], residual [M, Dk] or None)``, float32, data
    contiguous or the transpose of a contiguous tensor, the residual contiguous; the data gradient
    comes in data's layout, the residual's is the output's."""

    @staticmethod
    def forward(ctx, data, keys, residual=None):
        ctx.save_for_backward(data, keys)
        return _ext().forward(data, keys.detach(), None if residual is None else residual.detach())

    @staticmethod
    def backward(ctx, grad):
        data, keys = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_data, grad_keys = (
            _ext().backward(grad.contiguous(), data, keys.detach(), want[0], want[1])
            if want[0] or want[1]
            else (None, None)
        )
        grad_residual = grad if len(want) == 3 and want[2] else None  # apply(data, keys): two inputs
        return (grad_data if want[0] else None), (grad_keys if want[1] else None), grad_residual


def _ext():
    from rmt.ops.extensions import load_extension

    return load_extension("rmt_matrix_write_cpu")


def _fits(flat: torch.Tensor, keys: torch.Tensor) -> bool:
    """Where the kernel applies: CPU, Dk 16 or 32, data rows token- or key-major, and float32
    inputs, or float32 / bf16 inputs under CPU autocast to bf16 (:func:`_bf16_write`, which adds a
    residual afterwards)."""
    if torch.is_autocast_enabled("cpu"):
        dtypes = torch.get_autocast_dtype("cpu") == torch.bfloat16 and {flat.dtype, keys.dtype} <= {
            torch.float32,
            torch.bfloat16,
        }
    else:
        dtypes = flat.dtype == keys.dtype == torch.float32
    return (
        flat.device.type == "cpu"
        and dtypes
        and keys.shape[0] in (16, 32)
        and (flat.is_contiguous() or flat.t().is_contiguous())
    )


def _bf16_write(flat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The write as CPU autocast computes ``F.linear`` in bf16, by the float32 kernel: the inputs
    rounded to bf16 (autocast's cast), their products exact in float32, summed in float32 and
    rounded once to bf16, as oneDNN's bf16 GEMM does (up to the order of the n float32 additions).
    The gradients come from the float32 kernel too, rounded to bf16 on their way back through the
    casts, as F.linear's under autocast are. oneDNN's bf16 path for
    these shapes (n = R = 4) took 12x the kernel's time: 98 against 8 ms forward and backward of
    65k rows, one core."""
    with torch.autocast("cpu", enabled=False):
        out = FusedMatrixWrite.apply(flat.to(torch.bfloat16).float(), keys.to(torch.bfloat16).float())
    return out.to(torch.bfloat16)


def matrix_write(
    data: torch.Tensor, keys: torch.Tensor, backend: str = None, residual: torch.Tensor = None
) -> torch.Tensor:
    """``data [..., n]`` written with ``keys [Dk, n]``: ``[..., Dk]``, plus ``residual`` (that shape)
    where given. ``backend``: ``"cpu"`` (the kernel; by default wherever it applies: CPU float32,
    or under CPU autocast to bf16, Dk 16 or 32, data rows token- or key-major, the extension
    built; a contiguous float32 residual is added in the kernel) or ``"torch"`` (``F.linear``, then
    the addition)."""
    if backend not in (None,) + BACKENDS:
        raise ValueError(f"matrix_write: backend must be one of {BACKENDS}; got {backend!r}")
    flat = data.reshape(-1, data.shape[-1])
    if backend == "torch" or (backend is None and not (_fits(flat, keys) and _ext() is not None)):
        out = F.linear(data, keys)
    elif torch.is_autocast_enabled("cpu"):
        out = _bf16_write(flat, keys).view(*data.shape[:-1], keys.shape[0])
    elif residual is not None and residual.dtype == torch.float32 and residual.is_contiguous():
        return FusedMatrixWrite.apply(flat, keys, residual.view(flat.shape[0], -1)).view(residual.shape)
    else:
        out = FusedMatrixWrite.apply(flat, keys).view(*data.shape[:-1], keys.shape[0])
    return out if residual is None else residual + out
