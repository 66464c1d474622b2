"""The row-wise optimizer step fused into ``lookup_reduce``'s backward (FBGEMM TBE-style).

``lookup_reduce(..., update=FusedValueUpdate(table, optimizer))`` returns the same output as the
op, but its backward hands no gradient to the table: the kernel that sums each touched row's
gradient over its lookups steps that row and its optimizer state in place, as soon as the sum is
done (SparseAdam or RowWiseAdagrad of :mod:`rmt.ops.sparse_optim`, with their state, their
param group's hyper-parameters and their update rules). No ``[U, D]`` gradient, sparse or
dense, exists at any point; the score gradients come out as usual, computed from the rows before
they change.

What is stepped, and when:

* **Lookups of one step.** Every backward of a lookup recorded while ``update.final`` is True
  counts down ``update.pending``; the last one (pending 0) steps the table with the gradient of
  all lookups of the step: its own and those of the backwards before it, which kept only what
  the kernel needs (``grad_out``, indices, scores, block ids: ``T x E x D`` + ``T x K`` values per
  batch, where the gradient would be ``U x D`` with ``U`` up to ``T x K``) and computed their score
  gradients alone. So micro-batches accumulate exactly as gradients do: the trainer sets ``final``
  False for all but the step's last micro-batch. Outside the trainer ``final`` stays True and every
  backward is one step (FBGEMM's semantics), a table looked up twice in one forward once.
* **Data-parallel sum.** With ``group`` (the data-parallel group of a replicated table, the
  replica group of a shard) the step's lookups of every rank of the group are all-gathered
  before the kernel runs, in rank order, so every replica sums the same gradient in the same
  order and stays bit-identical; ``grad_scale`` (1 / data-parallel size) makes it the mean, as
  :func:`rmt.memory.groups.finish_memory_grads` does for the unfused gradient.
* **Clipping.** The step happens before the global gradient norm exists, so the value rows step
  with their unclipped (data-parallel mean) gradient. The kernel returns that gradient's squared
  norm; :func:`rmt.memory.groups.memory_grad_sq_norm` reads it (:meth:`pop_sq_norm`), so the
  reported ``grad_norm`` and the clipping factor of every other parameter are those of the
  unfused path.

Numerics: the fused kernels sum each row's gradient as the backward does (same lookups, same
order: bit-identical to the stored gradient for fp32 tables) and apply the update rules of
:mod:`rmt.ops.sparse_optim` to the sum, in the accumulation dtype: a bf16 table's gradient is
never rounded to bf16 (the unfused path rounds it once before its step), the state stays fp32,
and the new row is rounded once to the table's dtype. The plain torch formulation is
:func:`rmt.ops.reference.reference_backward_update` (the reference backward's rows, then the
optimizers' torch updates).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .dispatch import get_backend, select_backend
from .optimizer_codes import ROWWISE_ADAGRAD, SPARSE_ADAM
from .row_step import RowStep
from .validate import contiguous_as


def _concat(entries):
    """One batch of lookups from several: (grad_out, indices, scores, block_ids) concatenated over
    tokens."""
    cat = [torch.cat([e[i] for e in entries]) if len(entries) > 1 else entries[0][i] for i in range(3)]
    blocks = None if entries[0][3] is None else torch.cat([e[3] for e in entries])
    return cat[0], cat[1], cat[2], blocks


def _all_gather_tokens(x: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``x`` (ragged first dimension), in rank order."""
    P = dist.get_world_size(group)
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(n) for _ in range(P)]
    dist.all_gather(counts, n, group=group)
    counts = [int(c) for c in counts]
    padded = torch.cat([x, x.new_zeros((max(counts) - x.shape[0],) + tuple(x.shape[1:]))])
    out = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(out, padded.contiguous(), group=group)
    return [o[:c] for o, c in zip(out, counts)]


class FusedValueUpdate:
    """Steps ``param`` (a 2-D table) inside the backward of its lookups with ``optimizer`` (a
    :class:`~rmt.ops.sparse_optim.SparseAdam` or :class:`~rmt.ops.sparse_optim.RowWiseAdagrad`
    holding ``param``): its state (created as its own step would), its param group's ``lr``
    (what the scheduler set) and hyper-parameters. ``group`` / ``grad_scale``: see the module
    docstring. ``final``, ``pending``: the step's last lookups and their backwards still to run."""

    def __init__(
        self, param: torch.nn.Parameter, optimizer: torch.optim.Optimizer, group=None, grad_scale: float = 1.0
    ):
        from .sparse_optim import RowWiseAdagrad, SparseAdam

        if isinstance(optimizer, SparseAdam):
            self.kind = SPARSE_ADAM
        elif isinstance(optimizer, RowWiseAdagrad):
            self.kind = ROWWISE_ADAGRAD
        else:
            raise TypeError(
                f"FusedValueUpdate: optimizer must be rmt's SparseAdam or RowWiseAdagrad; "
                f"got {type(optimizer).__name__}"
            )
        self.param_group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
        if self.param_group is None:
            raise ValueError("FusedValueUpdate: the optimizer does not hold this parameter")
        self.param, self.optimizer = param, optimizer
        self.group = group if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 else None
        self.grad_scale = grad_scale
        self.final = True
        self.pending = 0
        self.stash: list = []
        self.sq_norm = 0.0
        self.updates = 0

    def record_forward(self) -> bool:
        """Called by each forward of a lookup that will be differentiated; returns ``final``."""
        if self.final:
            self.pending += 1
        return self.final

    def pop_sq_norm(self, host: bool = True):
        """Squared norm of the gradients stepped since the last call (see the module docstring): a
        float, or with ``host=False`` as the kernels left it, which on a GPU is a device scalar, so
        that reading it does not wait for the device (a float on the CPU)."""
        sq, self.sq_norm = self.sq_norm, 0.0
        return float(sq) if host else sq

    def backward(
        self,
        final: bool,
        backend: str,
        grad_out,
        table,
        indices,
        scores,
        block_ids,
        num_blocks,
        need_scores: bool = True,
    ):
        """The op's backward: the score gradients (None unless ``need_scores``); steps the table on
        the step's last backward."""
        entry = (grad_out, indices, scores.detach(), block_ids, num_blocks)
        if final:
            self.pending -= 1
        if not final or self.pending > 0:
            self.stash.append(entry)
            if not need_scores:
                return None
            return get_backend(backend).score_gradients(grad_out, table, indices, scores, block_ids, num_blocks)
        return self._step(backend, table, [*self.stash, entry], len(self.stash) if need_scores else None)

    def flush(self, backend: Optional[str] = None) -> None:
        """Step with the lookups kept by backwards that were not followed by the step's last one
        (none when every backward went as announced); resets the count."""
        self.pending = 0
        if self.stash:
            backend = backend or select_backend(self.param.device, dtype=self.param.dtype)
            self._step(backend, self.param.detach(), self.stash, None)

    def _row_step(self) -> RowStep:
        """The optimizer's step of the rows (its state, its param group's hyper-parameters,
        ``grad_scale`` negated to maximise); creates the state on first use and counts Adam's
        step."""
        g = self.param_group
        state = self.optimizer.state[self.param]
        if not state:
            state.update(self.optimizer.initial_state(self.param))
        if self.kind == SPARSE_ADAM:
            state["step"] += 1
            beta1, beta2 = g["betas"]
            sign = -1.0 if g.get("maximize", False) else 1.0
            return RowStep(
                SPARSE_ADAM,
                state["exp_avg"],
                state["exp_avg_sq"],
                float(g["lr"]),
                beta1,
                beta2,
                g["eps"],
                0.0,
                int(state["step"]),
                sign * self.grad_scale,
            )
        return RowStep(
            self.kind, state["sum"], None, float(g["lr"]), 0.0, 0.0, g["eps"], g["weight_decay"], 0, self.grad_scale
        )

    @torch.no_grad()
    def _step(self, backend, table, entries, current: Optional[int]):
        """Step with the lookups of ``entries``; returns the score gradients of ``entries[current]``
        (None without a current entry)."""
        self.stash = []
        num_blocks = entries[0][4]
        tokens = [e[1].shape[0] for e in entries]
        first = sum(tokens[:current]) if current is not None else 0
        count = tokens[current] if current is not None else 0
        grad_out, indices, scores, block_ids = _concat([e[:4] for e in entries])
        if self.group is not None:
            rank = dist.get_rank(self.group)
            every = [_all_gather_tokens(x, self.group) for x in (grad_out, indices, scores)]
            first += sum(x.shape[0] for x in every[1][:rank])
            grad_out, indices, scores = (torch.cat(x) for x in every)
            if block_ids is not None:
                block_ids = torch.cat(_all_gather_tokens(block_ids, self.group))
        grad_scores, sq = get_backend(backend).backward_update(
            grad_out.contiguous(),
            table,
            indices.contiguous(),
            scores.contiguous(),
            block_ids,
            num_blocks,
            first,
            count,
            self._row_step(),
        )
        torch.autograd.graph.increment_version(self.param)
        self.sq_norm = self.sq_norm + sq  # a device scalar on a GPU: read when clipping
        self.updates += 1
        return grad_scores if current is not None else None


class LookupReduceUpdateFunction(torch.autograd.Function):
    """The op's forward; the backward returns the score gradients and steps the table through
    ``update`` (:meth:`FusedValueUpdate.backward`) instead of returning its gradient."""

    @staticmethod
    def forward(ctx, table, scores, indices, block_ids, num_blocks, backend, update):
        ctx.save_for_backward(table, scores, indices, block_ids)
        ctx.num_blocks, ctx.backend, ctx.update = num_blocks, backend, update
        ctx.final = update.record_forward()
        return get_backend(backend).forward(table, indices, scores, block_ids, num_blocks)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        table, scores, indices, block_ids = ctx.saved_tensors
        grad_out = contiguous_as(grad_out, scores.dtype)
        grad_scores = ctx.update.backward(
            ctx.final, ctx.backend, grad_out, table, indices, scores, block_ids, ctx.num_blocks, ctx.needs_input_grad[1]
        )
        return None, grad_scores, None, None, None, None, None
