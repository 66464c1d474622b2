"""Row-wise optimizer steps for memory value tables with sparse (touched-rows) gradients.

``lookup_reduce(..., sparse_grad=True)`` leaves a coalesced sparse COO gradient on the table:
the unique touched rows and their gradient rows, never a table-sized dense tensor.

* :class:`SparseAdam` is ``torch.optim.SparseAdam`` (lazy Adam: moments of untouched rows are
  not decayed; same state, same results) whose step on fp32 tables runs a fused kernel, the C++
  one of ``csrc/sparse_optim_cpu.cpp`` on CPU and the Triton one of
  :mod:`rmt.ops.triton_sparse_optim` on GPU: one pass per touched row over the row and its two
  moments, where torch's step makes several passes through sparse_mask'ed copies. It equals
  torch's step to float rounding (torch's vectorized sqrt is off by up to 1 ulp; the C++
  kernel's is exact). Elsewhere (other dtypes, kernels unavailable) torch's step runs.
* :class:`RowWiseAdagrad` is written here because torch lacks it: ``torch.optim.Adagrad`` keeps
  one accumulator per element (a second table-sized tensor), whereas the row-wise variant used
  for large embedding tables (DLRM / FBGEMM) keeps one fp32 accumulator per row, the mean of the
  squared row gradient. :func:`rowwise_adagrad_update_` is its plain torch reference and the
  path where no fused kernel applies; the fused kernels compute the same to float rounding.

``RMT_SPARSE_OPTIM_FUSED=0`` forces the torch formulations.
"""

import importlib.util
import os

import torch

from ._build import load_extension

ENV_FUSED = "RMT_SPARSE_OPTIM_FUSED"


def _ext():
    return load_extension("rmt_sparse_optim_cpu", ["sparse_optim_cpu.cpp"],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"],
                          extra_ldflags=["-fopenmp"])


def fused_kernels(param):
    """The fused step kernels for ``param`` (a contiguous 2-D table): the C++ extension on CPU,
    the Triton kernels (:mod:`rmt.ops.triton_sparse_optim`) on CUDA; None where neither applies,
    the extension did not build, or ``RMT_SPARSE_OPTIM_FUSED=0``."""
    if os.environ.get(ENV_FUSED, "1") == "0" or param.dim() != 2 or not param.is_contiguous():
        return None
    if param.device.type == "cpu":
        return _ext()
    if param.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from . import triton_sparse_optim
        return triton_sparse_optim
    return None


def _fused_adam_dtype(param):
    """Dtypes the fused SparseAdam computes exactly like torch: fp32 (and fp64 in the C++ kernel)."""
    return param.dtype == torch.float32 or (param.dtype == torch.float64 and param.device.type == "cpu")


def coalesced(grad):
    """``grad.coalesce()`` for a sparse table gradient, without the sort when its rows are
    already strictly increasing (a dense gradient is returned as is).

    torch's AccumulateGrad stores a sparse gradient as a new tensor without the coalesced flag, so
    the coalesced gradient ``lookup_reduce(..., sparse_grad=True)`` returns reaches ``param.grad``
    marked uncoalesced, and ``coalesce()`` would sort and copy all its rows again (120 us for 127k
    rows of 64 on an H100, as long as the op's whole backward). One comparison of neighbouring
    rows tells; the flag is then set on ``grad`` itself.
    """
    if not grad.is_sparse or grad.is_coalesced():
        return grad
    if grad.sparse_dim() == 1:
        rows = grad._indices()[0]
        if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
            return grad._coalesced_(True)
    return grad.coalesce()


def rows_and_values(grad):
    """(unique row indices [U], gradient rows [U, D]) of a sparse COO or dense table gradient."""
    if grad.is_sparse:
        grad = coalesced(grad)
        return grad.indices()[0], grad.values()
    return torch.arange(grad.shape[0], device=grad.device), grad


class SparseAdam(torch.optim.SparseAdam):
    """``torch.optim.SparseAdam`` with the fused CPU step (see the module docstring)."""

    @staticmethod
    def initial_state(p):
        """The state torch's SparseAdam creates on a parameter's first step."""
        return {"step": 0, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def step(self, closure=None):
        fused = all(fused_kernels(p) is not None and _fused_adam_dtype(p)
                    for g in self.param_groups for p in g["params"])
        if not fused or any(g.get("maximize", False) for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p))
                state["step"] += 1
                rows, values = rows_and_values(p.grad)
                if rows.numel():
                    fused_kernels(p).sparse_adam_step(p, state["exp_avg"], state["exp_avg_sq"], rows,
                                                      values.contiguous(), float(group["lr"]), beta1, beta2,
                                                      group["eps"], int(state["step"]))
        return loss


@torch.no_grad()
def rowwise_adagrad_update_(param, state_sum, rows, values, lr, eps=1e-10, weight_decay=0.0):
    """In place: for each unique row r with gradient g (plus ``weight_decay * param[r]``),
    ``state_sum[r] += mean(g**2)`` and ``param[r] -= lr * g / (sqrt(state_sum[r]) + eps)``."""
    g = values.float()
    old = param.index_select(0, rows).float()
    if weight_decay:
        g = g + weight_decay * old
    state_sum.index_add_(0, rows, g.pow(2).mean(1))
    std = state_sum.index_select(0, rows).sqrt_().add_(eps)
    param.index_copy_(0, rows, (old - lr * g / std.unsqueeze(1)).to(param.dtype))


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per table row; accepts sparse COO or dense gradients."""

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0):
        if lr <= 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"RowWiseAdagrad: need lr > 0, eps >= 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def initial_state(p):
        """One fp32 accumulator per row."""
        return {"sum": torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad: parameters must be 2-D tables; got shape {tuple(p.shape)}")
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p))
                rows, values = rows_and_values(p.grad)
                ext = fused_kernels(p)
                if ext is not None:
                    ext.rowwise_adagrad_step(p, state["sum"], rows, values.contiguous(), float(group["lr"]),
                                             group["eps"], group["weight_decay"])
                else:
                    rowwise_adagrad_update_(p, state["sum"], rows, values, group["lr"], group["eps"],
                                            group["weight_decay"])
        return loss


def make_sparse_optimizer(params, kind="adam", lr=1e-3, **kwargs):
    """Optimizer for tables trained with sparse gradients: ``kind`` is "adam" or "rowwise_adagrad"."""
    if kind == "adam":
        return SparseAdam(params, lr=lr, **kwargs)
    if kind == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, **kwargs)
    raise ValueError(f"make_sparse_optimizer: kind must be 'adam' or 'rowwise_adagrad'; got {kind!r}")
