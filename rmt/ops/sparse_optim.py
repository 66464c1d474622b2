"""Row-wise optimizer steps for memory value tables with sparse (touched-rows) gradients.

``lookup_reduce(..., sparse_grad=True)`` leaves a coalesced sparse COO gradient on the table:
the unique touched rows and their gradient rows, never a table-sized dense tensor.

* Sparse Adam: ``torch.optim.SparseAdam`` already updates only the touched rows (lazy Adam:
  moments of untouched rows are not decayed), so it is used as is.
* Row-wise Adagrad is written here because torch lacks it: ``torch.optim.Adagrad`` keeps one
  accumulator per element (a second table-sized tensor), whereas the row-wise variant used for
  large embedding tables (DLRM / FBGEMM) keeps one fp32 accumulator per row, the mean of the
  squared row gradient.
"""

import torch


def rows_and_values(grad):
    """(unique row indices [U], gradient rows [U, D]) of a sparse COO or dense table gradient."""
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    return torch.arange(grad.shape[0], device=grad.device), grad


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
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                rows, values = rows_and_values(p.grad)
                rowwise_adagrad_update_(p, state["sum"], rows, values, group["lr"], group["eps"],
                                        group["weight_decay"])
        return loss


def make_sparse_optimizer(params, kind="adam", lr=1e-3, **kwargs):
    """Optimizer for tables trained with sparse gradients: ``kind`` is "adam" or "rowwise_adagrad"."""
    if kind == "adam":
        return torch.optim.SparseAdam(params, lr=lr, **kwargs)
    if kind == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, **kwargs)
    raise ValueError(f"make_sparse_optimizer: kind must be 'adam' or 'rowwise_adagrad'; got {kind!r}")
