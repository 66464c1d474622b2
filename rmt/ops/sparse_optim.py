"""Row-wise optimizer steps for memory value tables with sparse (touched-rows) gradients.

``lookup_reduce(..., sparse_grad=True)`` leaves a coalesced sparse COO gradient on the table:
the unique touched rows and their gradient rows, never a table-sized dense tensor.

* :class:`SparseAdam` is ``torch.optim.SparseAdam`` (lazy Adam: moments of untouched rows are
  not decayed) whose step runs a fused kernel, the C++ one of ``csrc/sparse_optim_cpu.cpp`` on
  CPU and the Triton one of :mod:`rmt.ops.triton_sparse_optim` on GPU: one pass per touched row
  over the row and its two moments, where torch's step makes several passes through
  sparse_mask'ed copies. :func:`sparse_adam_update_` is its plain torch reference (torch's
  operations in torch's order, equal to ``torch.optim.SparseAdam`` bit for bit on fp32 and fp64
  tables) and the path where no fused kernel applies. The kernels make the same operations
  without fused multiply-adds: the moments equal the reference's bit for bit, the rows up to the
  square root (torch's vectorized CPU sqrt is off by up to 1 ulp, the kernels' is correctly
  rounded).
* :class:`RowWiseAdagrad` is written here because torch lacks it: ``torch.optim.Adagrad`` keeps
  one accumulator per element (a second table-sized tensor), whereas the row-wise variant used
  for large embedding tables (DLRM / FBGEMM) keeps one fp32 accumulator per row, the mean of the
  squared row gradient. :func:`rowwise_adagrad_update_` is its plain torch reference and the
  path where no fused kernel applies; the fused kernels compute the same to float rounding
  (they sum a row's squares in another order).

State and update rule per table dtype (``g`` is the stored gradient row, of the table's dtype;
``p`` the stored row; ``f`` the exact conversion to the state's dtype; ``rn`` the rounding to the
table's dtype, to nearest with ties to even, the identity for fp32/fp64 tables):

* ``SparseAdam``. State: ``step`` (int); ``exp_avg`` and ``exp_avg_sq`` shaped like the table,
  float32 for bf16/fp16 tables, the table's dtype for fp32/fp64 tables. Each touched row, in the
  moments' dtype: ``m += (1 - b1) (f(g) - m)``; ``v += (1 - b2) (f(g)^2 - v)``;
  ``p <- rn(f(p) - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps))``.
* ``RowWiseAdagrad``. State: ``sum``, one float32 per row, whatever the table's dtype. Each
  touched row, in fp32: ``g' = f(g) + wd f(p)``; ``sum += mean(g'^2)``;
  ``p <- rn(f(p) - (lr / (sqrt(sum) + eps)) g')``.

So one step on a bf16 table is the fp32 step on the same (bf16-representable) row, gradient and
state, rounded once to bf16; over steps the bf16 table's trajectory stays within the accumulated
per-step roundings of the fp32 one (tests/test_ops_sparse_optim.py derives the bound).

Unlike ``torch.optim.SparseAdam``, whose moments take the parameter's dtype (bf16 moments for a
bf16 table: with ``beta2 = 0.999`` a step changes ``v`` by at most a thousandth of
``|g^2 - v|``, below bf16's half-ulp 2^-9 of ``v`` unless ``g^2`` exceeds ~3 ``v``, so ``v`` stops
following the gradients), :class:`SparseAdam` keeps fp32 moments, as FBGEMM's table-batched
embeddings do by default for bf16 weights; and its ``load_state_dict`` keeps them fp32 where
torch's casts every state tensor to the parameter's dtype (so does :class:`RowWiseAdagrad`'s).
The new row is rounded to nearest, deterministically (FBGEMM rounds bf16 weights
stochastically by default): an element's update smaller than half its bf16 ulp (2^-9 to 2^-8
of the element) is lost, which the fp32 state does not prevent.

``RMT_SPARSE_OPTIM_FUSED=0`` forces the torch formulations.
"""

import importlib.util
import math
import os

import torch

from .extensions import load_extension

ENV_FUSED = "RMT_SPARSE_OPTIM_FUSED"


def _ext():
    return load_extension("rmt_sparse_optim_cpu")


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
    """Tables the fused SparseAdam kernels take: fp32, bf16, fp16 (fp32 arithmetic), and fp64 in
    the C++ kernel (fp64 arithmetic)."""
    return param.dtype != torch.float64 or param.device.type == "cpu"


def adam_state_dtype(param):
    """The dtype of SparseAdam's moments for a table: float32 for bf16/fp16, else the table's."""
    return torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype


def coalesced(grad):
    """``grad.coalesce()`` for a sparse table gradient, without the sort when its rows are
    already strictly increasing (a dense gradient is returned as is).

    torch's AccumulateGrad stores a sparse gradient as a new tensor without the coalesced flag, so
    the coalesced gradient ``lookup_reduce(..., sparse_grad=True)`` returns reaches ``param.grad``
    marked uncoalesced, and ``coalesce()`` would sort and copy all its rows again (120 us for 127k
    rows of 64 on an H100, as long as the op's whole backward). One comparison of neighbouring
    rows tells; the flag is then set on ``grad`` itself.

    On the CPU a row's repeated entries are summed in the order they are stored (``index_add_``),
    where torch's ``coalesce`` sums them in an order that depends on the other rows: so the rows
    of a gradient split in parts sum alike in each part (a host table's cached rows,
    :mod:`rmt.memory.host_cache`, whose run equals the uncached one bit for bit).
    """
    if not grad.is_sparse or grad.is_coalesced():
        return grad
    if grad.sparse_dim() == 1:
        rows = grad._indices()[0]
        if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
            return grad._coalesced_(True)
        if grad.device.type == "cpu":
            unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            values = grad._values()
            sums = values.new_zeros((unique.numel(),) + tuple(values.shape[1:])).index_add_(0, inverse, values)
            return torch.sparse_coo_tensor(unique.unsqueeze(0), sums, grad.shape, check_invariants=False)._coalesced_(
                True
            )
    return grad.coalesce()


def rows_and_values(grad):
    """(unique row indices [U], gradient rows [U, D]) of a sparse COO or dense table gradient."""
    if grad.is_sparse:
        grad = coalesced(grad)
        return grad.indices()[0], grad.values()
    return torch.arange(grad.shape[0], device=grad.device), grad


def row_square_sums(values: torch.Tensor, chunk_elements: int = 1 << 18) -> torch.Tensor:
    """float64 sum of squares of each row of ``values`` (``[U]``), a bounded chunk of rows at a
    time (a float64 copy of a table-sized gradient would cost twice the table). Each row's sum
    depends on that row alone, so the rows of a gradient split in two parts give the same sums."""
    rows = values.flatten(1) if values.dim() > 1 else values.reshape(-1, 1)
    step = max(1, chunk_elements // max(rows.shape[1], 1))
    sums = [rows[r : r + step].double().pow(2).sum(1) for r in range(0, rows.shape[0], step)]
    if len(sums) == 1:
        return sums[0]
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=values.device)


class _TableOptimizer:
    """What the row-wise table optimizers share (mixed in before their torch base class): the
    step (:meth:`step` hands each parameter with a gradient to :meth:`step_param`, which checks
    it, creates its state and hands the gradient's touched rows to the subclass's
    ``update_rows``), and ``load_state_dict``, which keeps the dtypes of the tensors
    ``initial_state`` creates (``_STATE_TENSORS``, of dtype ``state_dtype(param)``). torch's casts
    every floating state tensor to its parameter's dtype, which would round a bf16 table's fp32
    state to bf16; these tensors are held back from it and converted to the state dtype
    directly."""

    _STATE_TENSORS = ()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_param(group, p, p.grad)
        return loss

    @torch.no_grad()
    def step_param(self, group: dict, p, grad, state=None) -> None:
        """One table's step with gradient ``grad`` and ``group``'s hyper-parameters (a copy of its
        param group may be passed: a host table steps on a thread of its own,
        :mod:`rmt.memory.host_steps`, while the scheduler sets the next step's ``lr``). ``state``:
        the state of ``p`` when it is not this optimizer's own (the rows a host table caches on the
        device, :mod:`rmt.memory.host_cache`, with their state and the table's step count)."""
        self.check(p, grad)
        state = self.state[p] if state is None else state
        if not state:
            state.update(self.initial_state(p))
        rows, values = rows_and_values(grad)
        self.update_rows(group, p, state, rows, values)

    def load_state_dict(self, state_dict):
        held = {}
        rest = dict(state_dict, state={})
        for key, entry in state_dict["state"].items():
            held[key] = {name: value for name, value in entry.items() if name in self._STATE_TENSORS}
            rest["state"][key] = {name: value for name, value in entry.items() if name not in self._STATE_TENSORS}
        super().load_state_dict(rest)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for key, p in zip(saved_ids, params):
            for name, value in held.get(key, {}).items():
                self.state[p][name] = value.to(device=p.device, dtype=self.state_dtype(p))


@torch.no_grad()
def sparse_adam_update_(param, exp_avg, exp_avg_sq, rows, values, lr, beta1, beta2, eps, step):
    """In place on the unique ``rows`` (gradient rows ``values``): the SparseAdam update of the
    module docstring, with ``torch.optim.SparseAdam``'s operations in its order, computed in the
    moments' dtype and rounded once to the table's."""
    g = values.to(exp_avg.dtype)
    old_m, old_v = exp_avg.index_select(0, rows), exp_avg_sq.index_select(0, rows)
    m = g.sub(old_m).mul_(1 - beta1).add_(old_m)
    v = g.pow(2).sub_(old_v).mul_(1 - beta2).add_(old_v)
    exp_avg.index_copy_(0, rows, m)
    exp_avg_sq.index_copy_(0, rows, v)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    new = param.index_select(0, rows).to(exp_avg.dtype).add_(m.div_(v.sqrt_().add_(eps)).mul_(-step_size))
    param.index_copy_(0, rows, new.to(param.dtype))


class SparseAdam(_TableOptimizer, torch.optim.SparseAdam):
    """``torch.optim.SparseAdam`` with fused steps and fp32 moments for bf16/fp16 tables (see the
    module docstring); its constructor and hyper-parameters are torch's."""

    _STATE_TENSORS = ("exp_avg", "exp_avg_sq")
    state_dtype = staticmethod(adam_state_dtype)

    @staticmethod
    def initial_state(p):
        """``step`` 0 and zero moments of :func:`adam_state_dtype` (torch's SparseAdam creates
        them on a parameter's first step, of the parameter's dtype)."""
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(p, dtype=adam_state_dtype(p), memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, dtype=adam_state_dtype(p), memory_format=torch.preserve_format),
        }

    @staticmethod
    def check(p, grad) -> None:
        if not grad.is_sparse:
            raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")

    def update_rows(self, group: dict, p, state: dict, rows, values) -> None:
        """The Adam step of the touched ``rows`` (gradient rows ``values``): the fused kernel where
        one applies, else :func:`sparse_adam_update_`; the step is counted even without rows."""
        beta1, beta2 = group["betas"]
        state["step"] += 1
        if group["maximize"]:
            values = -values
        if not rows.numel():
            return
        kernels = fused_kernels(p) if _fused_adam_dtype(p) else None
        update = kernels.sparse_adam_step if kernels is not None else sparse_adam_update_
        update(
            p,
            state["exp_avg"],
            state["exp_avg_sq"],
            rows,
            values.contiguous(),
            float(group["lr"]),
            beta1,
            beta2,
            group["eps"],
            int(state["step"]),
        )


@torch.no_grad()
def rowwise_adagrad_update_(param, state_sum, rows, values, lr, eps=1e-10, weight_decay=0.0):
    """In place: for each unique row r with gradient g (plus ``weight_decay * param[r]``),
    ``state_sum[r] += mean(g**2)`` and ``param[r] -= (lr / (sqrt(state_sum[r]) + eps)) * g``, in
    fp32, the new row rounded once to the table's dtype (the module docstring's rule)."""
    g = values.float()
    old = param.index_select(0, rows).float()
    if weight_decay:
        g = g + weight_decay * old
    state_sum.index_add_(0, rows, g.pow(2).mean(1))
    scale = lr / state_sum.index_select(0, rows).sqrt_().add_(eps)
    param.index_copy_(0, rows, (old - scale.unsqueeze(1) * g).to(param.dtype))


class RowWiseAdagrad(_TableOptimizer, torch.optim.Optimizer):
    """Adagrad with one fp32 accumulator per table row (see the module docstring); accepts sparse
    COO or dense gradients."""

    _STATE_TENSORS = ("sum",)

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0):
        if lr <= 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"RowWiseAdagrad: need lr > 0, eps >= 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}"
            )
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def state_dtype(p):
        """The accumulator's dtype: float32 for every table."""
        return torch.float32

    @staticmethod
    def initial_state(p):
        """One fp32 accumulator per row."""
        return {"sum": torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)}

    @staticmethod
    def check(p, grad) -> None:
        if p.dim() != 2:
            raise ValueError(f"RowWiseAdagrad: parameters must be 2-D tables; got shape {tuple(p.shape)}")

    def update_rows(self, group: dict, p, state: dict, rows, values) -> None:
        """The row-wise Adagrad step of the touched ``rows`` (gradient rows ``values``): the fused
        kernel where one applies, else :func:`rowwise_adagrad_update_`."""
        ext = fused_kernels(p)
        if ext is not None:
            ext.rowwise_adagrad_step(
                p, state["sum"], rows, values.contiguous(), float(group["lr"]), group["eps"], group["weight_decay"]
            )
        else:
            rowwise_adagrad_update_(p, state["sum"], rows, values, group["lr"], group["eps"], group["weight_decay"])


def make_sparse_optimizer(params, kind="adam", lr=1e-3, **kwargs):
    """Optimizer for tables trained with sparse gradients: ``kind`` is "adam" or "rowwise_adagrad"."""
    if kind == "adam":
        return SparseAdam(params, lr=lr, **kwargs)
    if kind == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, **kwargs)
    raise ValueError(f"make_sparse_optimizer: kind must be 'adam' or 'rowwise_adagrad'; got {kind!r}")
