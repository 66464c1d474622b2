"""RMSNorm over all Dk*Dv entries of a token's residual matrix (RMT, Mak & Flanigan §2.2; the
authors normalize the whole matrix jointly, with an elementwise gain):

    r_t = 1 / sqrt(mean_j x_tj^2 + eps),   y_tj = x_tj r_t g_j

for ``x [T, n]`` (n = Dk*Dv) and ``g [n]``. Backward, with ``c_t = sum_j dy_tj g_j x_tj``:
``dx_tj = r_t (dy_tj g_j - x_tj c_t r_t^2 / n)`` and ``dg_j = sum_t r_t dy_tj x_tj``.

Two implementations with a hand-written backward: :class:`TorchMatrixRMSNorm`, the reference, a few
torch ops (3 passes over ``[T, n]`` forward, 5 backward, its reductions as GEMVs: about half the
passes of the autograd composite), and the fused CPU kernel of ``csrc/matrix_rmsnorm_cpu.cpp``
(one pass each way: the residual matrix is Dk/R times wider than the transformer's residual
vector, so the passes over it decide the norm's cost). torch's own ``F.rms_norm`` was 2.5x slower
than the reference on CPU (composite backward).

In the RMT the norm is always followed by a read (Eq. 13) with n key vectors,
``out[t, v, h] = sum_k keys[h, k] y_t[v, k]`` (``y_t`` the row as a ``Dv x Dk`` matrix):
:func:`matrix_rms_norm_read` computes both, the reference as the norm followed by one GEMM and
the fused CPU kernel blockwise so that the normalized matrix never goes to memory
(``norm_read_*`` in the same C++ file).
"""

from __future__ import annotations

import torch

BACKENDS = ("cpu", "torch")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


class TorchMatrixRMSNorm(torch.autograd.Function):
    """The reference: ``apply(x [T, n], gain [n], eps)``."""

    @staticmethod
    def forward(ctx, x, gain, eps):
        n = x.shape[-1]
        acc = torch.promote_types(x.dtype, torch.float32)
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc).square_().div_(n)
        rstd = ms.add_(eps).rsqrt_().to(x.dtype)
        ctx.save_for_backward(x, gain, rstd)
        return (x * rstd).mul_(gain)

    @staticmethod
    def backward(ctx, grad):
        x, gain, rstd = ctx.saved_tensors
        n, g = x.shape[-1], gain.to(x.dtype)
        grad = grad.to(x.dtype)
        gx = grad * x
        grad_gain = (rstd.t() @ gx).view(-1).to(gain.dtype) if ctx.needs_input_grad[1] else None
        dot = gx @ g.unsqueeze(1)  # sum_j grad_j gain_j x_j per token
        grad_x = torch.addcmul(grad * g, x, dot * rstd.square() / -n).mul_(rstd)
        return grad_x, grad_gain, None


class FusedMatrixRMSNorm(torch.autograd.Function):
    """The CPU kernel: ``apply(x [T, n] contiguous, gain [n] of x's dtype, eps)``."""

    @staticmethod
    def forward(ctx, x, gain, eps):
        y, rstd = _ext().forward(x, gain, eps)
        ctx.save_for_backward(x, gain, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, gain, rstd = ctx.saved_tensors
        grad_x, grad_gain = _ext().backward(grad.contiguous().to(x.dtype), x, gain, rstd, ctx.needs_input_grad[1])
        return grad_x, (grad_gain if ctx.needs_input_grad[1] else None), None


class FusedMatrixRMSNormRead(torch.autograd.Function):
    """The fused CPU norm + read: ``apply(x [T, Dv*Dk] contiguous, gain [Dv*Dk], keys [n, Dk], eps,
    key_major, pass_residual)``, all of x's dtype. Saves x and rstd only. With ``pass_residual``
    it also returns x (a view), whose gradient the kernel adds to the norm's as it writes it."""

    @staticmethod
    def forward(ctx, x, gain, keys, eps, key_major, pass_residual=False):
        out, rstd = _ext().norm_read_forward(x, gain, keys, eps, key_major)
        ctx.save_for_backward(x, gain, keys, rstd)
        ctx.key_major = key_major
        return (out, x.view_as(x)) if pass_residual else out

    @staticmethod
    def backward(ctx, grad, grad_residual=None):
        x, gain, keys, rstd = ctx.saved_tensors
        want = ctx.needs_input_grad
        if grad_residual is not None:
            grad_residual = grad_residual.to(x.dtype).contiguous()
        grad_x, grad_gain, grad_keys = _ext().norm_read_backward(
            grad.to(x.dtype).contiguous(), x, gain, keys, rstd, ctx.key_major, want[1], want[2], grad_residual
        )
        return grad_x, (grad_gain if want[1] else None), (grad_keys if want[2] else None), None, None, None


def _ext():
    from rmt.ops.extensions import load_extension

    return load_extension("rmt_matrix_rmsnorm_cpu")


def _backend(op: str, backend, x: torch.Tensor, *params: torch.Tensor) -> str:
    """``backend`` checked, or when None ``"cpu"`` for a contiguous 2-D CPU ``x`` of a fused dtype
    whose ``params`` share its dtype (where the kernel builds), else ``"torch"``."""
    if backend is None:
        fits = (
            x.device.type == "cpu"
            and x.dim() == 2
            and x.dtype in _FUSED_DTYPES
            and x.is_contiguous()
            and all(p.dtype == x.dtype for p in params)
        )
        return "cpu" if fits and _ext() is not None else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}; got {backend!r}")
    return backend


def matrix_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float, backend: str = None) -> torch.Tensor:
    """``x [T, n]`` normalized per row with gain ``[n]``. ``backend``: ``"cpu"`` (the fused kernel,
    the default for contiguous CPU float32/float64/bfloat16 inputs with a gain of the same dtype,
    where it builds) or ``"torch"`` (:class:`TorchMatrixRMSNorm`)."""
    if _backend("matrix_rms_norm", backend, x, gain) == "cpu":
        return FusedMatrixRMSNorm.apply(x, gain, eps)
    return TorchMatrixRMSNorm.apply(x, gain, eps)


def matrix_rms_norm_read(
    x: torch.Tensor,
    gain: torch.Tensor,
    keys: torch.Tensor,
    eps: float,
    key_major: bool = False,
    backend: str = None,
    pass_residual: bool = False,
):
    """Normalize ``x [T, Dv*Dk]`` (gain ``[Dv*Dk]``) and read it with ``keys [n, Dk]`` (Eq. 13):
    ``[T*Dv, n]`` with row ``t*Dv + v``, or with ``key_major`` its transpose ``[n, T*Dv]`` (then
    each key's reads of a token's Dv entries are contiguous). ``backend``: ``"cpu"`` (the fused
    kernel, the default where :func:`matrix_rms_norm` would use it and keys have x's dtype) or
    ``"torch"`` (:func:`matrix_rms_norm` then one GEMM). ``pass_residual``: return ``(read, x)``,
    for a residual stream that continues from x: the kernel then adds the gradient that reaches x
    through that stream to the norm's as it writes x's gradient, the bits of autograd's separate
    addition without its pass over memory."""
    if _backend("matrix_rms_norm_read", backend, x, gain, keys) == "cpu":
        return FusedMatrixRMSNormRead.apply(x, gain, keys, eps, key_major, pass_residual)
    y = matrix_rms_norm(x, gain, eps, backend).reshape(-1, keys.shape[1])
    out = torch.mm(keys, y.t()) if key_major else torch.mm(y, keys.t())
    return (out, x) if pass_residual else out
