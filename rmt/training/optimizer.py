"""AdamW with parameter groups, the warmup + decay schedule, and model-parallel grad clipping.

Apex's FusedAdam is used when importable on CUDA; otherwise torch's fused AdamW, on CPU too: one
pass per tensor, 6.9x faster than the foreach AdamW on 2 CPU threads at 46M parameters (86 vs
594 ms per step) with the same results, as fast as DeepSpeed's ``DeepSpeedCPUAdam``
(``tools/bench_optimizer.py``), and no temporary the size of the largest tensor (for a
dense-gradient memory table, its whole shard). With ``memory.value_optimizer`` sparse_adam or
rowwise_adagrad the memory value tables, whose gradients are then sparse (touched rows), are
stepped by that optimizer instead, chained
after AdamW so the scheduler and checkpoints see one optimizer; with
``memory.fused_value_optimizer`` that optimizer's step runs inside the lookups' backward
(:mod:`rmt.ops.fused_update`), on its state and param groups, and its ``step()`` finds no
gradient to apply.

Weight decay (``train.weight_decay`` wd) applies to every parameter of two or more dimensions
(the layers' weight matrices; the memory layers' query, keys, cores, convolution and
projections; MoE routers and experts) except the embedding tables (word and position), the
unembedding (output layer) and memory value tables; never to norm gains or biases. ``train.decay_rmt_keys`` adds the RMT's embedding and unembedding key matrices
(the RMT authors' recipe; their tables stay exempt). Per step a decayed weight shrinks by
``lr_t * wd`` (``train.weight_decay_mode: lr``, AdamW as torch and megatron define it) or by
``wd * lr_t / lr`` (``schedule``: decoupled from the LR's size, following its schedule, as in
Loshchilov & Hutter and the RMT authors' optax chain). Both run as AdamW with a per-group decay
coefficient: ``schedule`` is AdamW with coefficient ``wd / lr``.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from rmt.config import RMTConfig
from rmt.memory.groups import attach_fused_updates, memory_grad_sq_norm, self_reduced
from rmt.memory.optim import ValueLRScheduler, split_value_group
from rmt.models.rmt import RMT_KEY_MATRICES
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam
from rmt.parallel import compat


def _no_decay(name: str, param: torch.Tensor, decay_rmt_keys: bool = False) -> bool:
    """Norm gains, biases, embeddings and the unembedding are not decayed (the RMT's embedding
    and unembedding key matrices are, with ``decay_rmt_keys``)."""
    if decay_rmt_keys and name.endswith(RMT_KEY_MATRICES):
        return False
    return param.dim() < 2 or "embedding" in name or "output_layer" in name


def decay_coefficient(config: RMTConfig) -> float:
    """AdamW's per-group coefficient that gives ``train.weight_decay_mode``'s shrink per step
    (AdamW shrinks by ``lr_t * coefficient``)."""
    t = config.train
    return t.weight_decay / t.lr if t.weight_decay_mode == "schedule" else t.weight_decay


def param_groups(chunks: List[torch.nn.Module], config: RMTConfig) -> List[dict]:
    decay, no_decay = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (no_decay if _no_decay(name, p, config.train.decay_rmt_keys) else decay).append(p)
    wd = decay_coefficient(config)
    groups = [g for g in ({"params": decay, "weight_decay": wd, "wd_mult": 1.0},
                          {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}) if g["params"]]
    return split_value_group(groups, config.memory.value_lr_mult)


class ChainedOptimizer:
    """Several torch optimizers over disjoint parameters, stepped as one: ``param_groups`` is
    theirs concatenated (the LR scheduler sets each group's ``lr``), ``state[p]`` is the state
    of the optimizer that owns ``p``. torch has no such wrapper (megatron-core's
    ChainedOptimizer needs its own optimizer classes)."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self._owner: Dict[torch.nn.Parameter, torch.optim.Optimizer] = {
            p: o for o in optimizers for g in o.param_groups for p in g["params"]}

    @property
    def param_groups(self) -> List[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def owner(self, p: torch.nn.Parameter) -> torch.optim.Optimizer:
        """The optimizer that steps ``p``."""
        return self._owner[p]

    @property
    def state(self) -> "_ChainedState":
        return _ChainedState(self._owner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


class _ChainedState:
    def __init__(self, owner):
        self.owner = owner

    def __getitem__(self, p):
        return self.owner[p].state[p]

    def __contains__(self, p) -> bool:
        return p in self.owner and p in self.owner[p].state


def build_optimizer(chunks: List[torch.nn.Module], config: RMTConfig):
    t = config.train
    groups = param_groups(chunks, config)
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    is_sparse = [any(getattr(p, "memory_sparse_grad", False) for p in g["params"]) for g in groups]
    sparse = [g for g, flag in zip(groups, is_sparse) if flag]
    dense = build_adamw([g for g, flag in zip(groups, is_sparse) if not flag], kwargs)
    if not sparse:
        return dense
    if config.memory.value_optimizer == "sparse_adam":
        values = SparseAdam(sparse, **kwargs)
    else:
        values = RowWiseAdagrad(sparse, lr=t.lr, eps=t.adam_eps)
    if config.memory.fused_value_optimizer:
        attach_fused_updates([p for g in sparse for p in g["params"]], values)
    return ChainedOptimizer([dense, values])


def build_adamw(groups: List[dict], kwargs: dict) -> torch.optim.Optimizer:
    if torch.cuda.is_available():
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(groups, adam_w_mode=True, **kwargs)
        except ImportError:
            pass
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def warmup_steps(config: RMTConfig) -> int:
    """``train.warmup_steps`` clamped below ``train.steps`` (the schedule must reach its peak
    before the last step; a smoke run of a few steps uses a config made for long runs)."""
    return min(config.train.warmup_steps, config.train.steps - 1)


class ScaledLRScheduler(ValueLRScheduler):
    """The schedule times ``scale``, the validation-driven factor of
    :class:`rmt.training.lr_control.ValidationLR` (1 unless ``train.lr_curriculum_decay`` or
    ``train.lr_plateau_decay`` lowers it); ``step(0)`` applies a new ``scale`` at once."""

    scale = 1.0

    def get_lr(self, param_group: dict) -> float:
        return super().get_lr(param_group) * self.scale


def build_scheduler(optimizer, config: RMTConfig) -> OptimizerParamScheduler:
    """megatron-core's scheduler: linear warmup to ``lr`` then cosine/linear decay to
    ``min_lr_ratio * lr`` at the last step, times the validation-driven ``scale``
    (:class:`ScaledLRScheduler`). The decay coefficient (:func:`decay_coefficient`)
    stays constant. Memory values (a group of their own) get ``memory.value_lr_mult`` times
    that, decaying linearly to 1x."""
    t = config.train
    wd = decay_coefficient(config)
    return ScaledLRScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.lr * t.min_lr_ratio,
        lr_warmup_steps=warmup_steps(config), lr_decay_steps=t.steps, lr_decay_style=t.lr_decay_style,
        start_wd=wd, end_wd=wd, wd_incr_steps=t.steps,
        wd_incr_style="constant")


def grad_sq_norm(grads: List[torch.Tensor], group) -> torch.Tensor:
    """Sum of the squares of ``grads``' elements (fp32) over ``group``, a 1-element tensor left on
    the device. megatron's ``get_grad_norm_fp32`` computes this with apex's fused
    ``multi_tensor_l2norm`` where apex is installed; its fallback without apex turns every
    parameter's norm into a Python float, a host wait for the device per parameter (188 a step at
    the UltraMem-151M-x12 shape on an H100, ``tools/bench_memory_stream.py --profile``). torch's
    fused ``_foreach_norm`` needs neither."""
    if grads:
        sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))).square()
    else:
        sq = torch.zeros((), device=compat.device())
    sq = sq.reshape(1)
    torch.distributed.all_reduce(sq, group=group)
    return sq


def global_grad_sq_norm(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """Squared global L2 norm of the gradients of ``params`` (each TP-duplicated parameter
    counted once): replicated parameters over the model-parallel group, expert-parallel MoE
    experts (megatron's ``allreduce = False``) over the expert-tensor x expert-model x pipeline
    group that holds each expert once, self-reduced memory tables (sharded or with sparse
    gradients) by :func:`~rmt.memory.groups.memory_grad_sq_norm`. A one-element fp64 tensor on
    the compute device: nothing here waits for it."""
    grads = {True: [], False: []}
    for p in params:
        if p.grad is not None and not self_reduced(p) and param_is_not_shared(p) \
                and param_is_not_tensor_parallel_duplicate(p):
            grads[getattr(p, "allreduce", True)].append(p.grad)
    norm_sq = grad_sq_norm(grads[True], parallel_state.get_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        norm_sq += grad_sq_norm(grads[False], parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return norm_sq + memory_grad_sq_norm(params)


def clip_gradients(params: List[torch.nn.Parameter], max_norm: float, norm: Optional[float] = None) -> float:
    """Scales the gradients of ``params`` in place when their global L2 norm is above ``max_norm``;
    returns the norm. ``norm``: that norm where the caller read it already (the trainer reads it
    with the step's losses, one wait for the device), else :func:`global_grad_sq_norm` is read
    here."""
    if norm is None:
        norm = float(global_grad_sq_norm(params)) ** 0.5
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        torch._foreach_mul_([p.grad for p in params if p.grad is not None and not p.grad.is_sparse], scale)
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                p.grad.mul_(scale)
    return norm
