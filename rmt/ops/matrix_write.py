"""The RMT's write (Mak & Flanigan Eq. 12 without the norm): n data vectors stored in a token's
Dv x Dk residual matrix with n key vectors,

    out[j, k] = sum_h data[j, h] keys[k, h]

for ``data [..., n]`` (rows j = a token's Dv entries), ``keys [Dk, n]``, ``out [..., Dk]``: a linear
layer with n inputs. The reference is ``F.linear``; the CPU kernel of ``csrc/matrix_write_cpu.cpp``
computes the same products with register tiles and a key-major GEMM, where MKL's sgemm is slow on
the backward of these shapes (n = R, 4 in the tiny RMT), for float32 with Dk 16 or 32, data
token-major (contiguous) or key-major (the transpose of a contiguous tensor: the attention's
output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("cpu", "torch")


class FusedMatrixWrite(torch.autograd.Function):
    """The CPU kernel: ``apply(data [M, n], keys [Dk, n])``, float32, data contiguous or the
    transpose of a contiguous tensor; the data gradient comes in data's layout."""

    @staticmethod
    def forward(ctx, data, keys):
        ctx.save_for_backward(data, keys)
        return _ext().forward(data, keys.detach())

    @staticmethod
    def backward(ctx, grad):
        data, keys = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_data, grad_keys = _ext().backward(grad.contiguous(), data, keys.detach(), want[0], want[1])
        return (grad_data if want[0] else None), (grad_keys if want[1] else None)


def _ext():
    from rmt.ops.extensions import load_extension

    return load_extension("rmt_matrix_write_cpu")


def _fits(flat: torch.Tensor, keys: torch.Tensor) -> bool:
    """Where the kernel applies. Not under autocast, whose bf16 linear layers the write follows."""
    return (flat.device.type == "cpu" and flat.dtype == torch.float32 and keys.dtype == torch.float32
            and keys.shape[0] in (16, 32) and (flat.is_contiguous() or flat.t().is_contiguous())
            and not torch.is_autocast_enabled("cpu"))


def matrix_write(data: torch.Tensor, keys: torch.Tensor, backend: str = None) -> torch.Tensor:
    """``data [..., n]`` written with ``keys [Dk, n]``: ``[..., Dk]``. ``backend``: ``"cpu"`` (the
    kernel; by default wherever it applies: CPU float32 outside autocast, Dk 16 or 32, data rows
    token- or key-major, the extension built) or ``"torch"`` (``F.linear``)."""
    if backend not in (None,) + BACKENDS:
        raise ValueError(f"matrix_write: backend must be one of {BACKENDS}; got {backend!r}")
    flat = data.reshape(-1, data.shape[-1])
    if backend == "torch" or (backend is None and not (_fits(flat, keys) and _ext() is not None)):
        return F.linear(data, keys)
    return FusedMatrixWrite.apply(flat, keys).view(*data.shape[:-1], keys.shape[0])
