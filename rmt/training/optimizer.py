"""The optimizers of a run, the warmup + decay schedule, and model-parallel grad clipping.

The dense parameters (everything but the memory value tables) are stepped by megatron-core's
own optimizer (``get_megatron_optimizer``): its ``FP32Optimizer`` in fp32, its float16 optimizer
(bf16 parameters, fp32 main parameters) with ``train.precision: bf16``, its
``DistributedOptimizer`` (main parameters and Adam moments sharded over the data-parallel
group) with ``train.distributed_optimizer``; MoE experts with expert parallelism in its second
optimizer over the expert data-parallel group, as megatron chains them. Its AdamW is apex's or
Transformer Engine's fused one where importable, else torch's, made fused on the CPU
(:func:`_fused_on_cpu`).

The memory value tables keep optimizers of their own (:class:`Optimizers`): torch's AdamW for
tables with dense gradients, and with ``memory.value_optimizer`` sparse_adam or rowwise_adagrad
that optimizer for their touched-row gradients (with ``memory.fused_value_optimizer`` its step
runs inside the lookups' backward, :mod:`rmt.ops.fused_update`, and its ``step()`` finds no
gradient). They stay outside megatron's optimizer because their states are checkpointed as table
shards that reshard between partitions (:mod:`rmt.training.table_checkpoint`), and because a
sharded table's gradient is not a DDP gradient; to shard a table's state, shard the table
(``memory.partition``).

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
from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rmt.config import TABLE_TYPES, RMTConfig
from rmt.memory.descriptor import descriptor, is_table
from rmt.memory.groups import attach_fused_updates, frozen, host_cache, memory_grad_sq_norm, self_reduced
from rmt.memory.host_steps import held_back, launch_host_steps
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


def param_groups(chunks: List[torch.nn.Module], config: RMTConfig, tables: Optional[bool] = None) -> List[dict]:
    """Decayed and undecayed groups of the trainable parameters; ``tables`` True / False: only
    the memory value tables (in a group of their own with ``memory.value_lr_mult``) / only the
    others."""
    decay, no_decay = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad and (tables is None or is_table(p) == tables):
                (no_decay if _no_decay(name, p, config.train.decay_rmt_keys) else decay).append(p)
    wd = decay_coefficient(config)
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": wd, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
        )
        if g["params"]
    ]
    return split_value_group(groups, config.memory.value_lr_mult)


def optimizer_config(config: RMTConfig) -> OptimizerConfig:
    """megatron's ``OptimizerConfig`` of the dense parameters. Its own clipping is off: the
    trainer clips by the global norm over dense parameters and tables together
    (:meth:`Optimizers.grad_sq_norm`)."""
    t = config.train
    bf16 = t.precision == "bf16"
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.lr * t.min_lr_ratio,
        weight_decay=decay_coefficient(config),
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=t.distributed_optimizer,
        overlap_param_gather=t.overlap_param_gather,
    )


def build_dense_optimizer(chunks: List[torch.nn.Module], config: RMTConfig):
    """megatron's optimizer (``get_megatron_optimizer``) over the DDP-wrapped ``chunks``'
    parameters other than memory value tables, with rmt's weight-decay exemptions as its
    parameter-group override."""
    exempt = ParamWithNamePredicate(
        name="rmt_no_decay", fn=lambda p, name: _no_decay(name, p, config.train.decay_rmt_keys)
    )
    with frozen([p for c in chunks for p in c.parameters() if is_table(p)]):
        dense = get_megatron_optimizer(
            optimizer_config(config), chunks, config_overrides={ParamKey(with_name_predicate=exempt): {"wd_mult": 0.0}}
        )
    _fused_on_cpu(dense)
    return dense


def _fused_on_cpu(dense) -> None:
    """Without apex and Transformer Engine megatron-core steps with torch's AdamW in its default
    form, on the CPU a loop over tensors: 6.9x slower than torch's fused form at 46M parameters
    (594 vs 86 ms a step on 2 threads, ``tools/bench_optimizer.py``), with the same arithmetic.
    Switch its groups to the fused form before the state exists (torch reads ``fused`` per
    group at each step)."""
    if compat.cuda_available():
        return
    for inner in getattr(dense, "chained_optimizers", [dense]):
        opt = inner.optimizer
        if type(opt) is torch.optim.AdamW:
            opt.defaults.update(fused=True, foreach=False)
            for group in opt.param_groups:
                group.update(fused=True, foreach=False)


def build_table_optimizers(chunks: List[torch.nn.Module], config: RMTConfig) -> List[torch.optim.Optimizer]:
    """The memory value tables' optimizers: torch's AdamW (fused) for dense gradients,
    ``memory.value_optimizer``'s for sparse ones (attached to the lookups' backward with
    ``memory.fused_value_optimizer``)."""
    t = config.train
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    groups = param_groups(chunks, config, tables=True)
    is_sparse = [any(descriptor(p).sparse_grad for p in g["params"]) for g in groups]
    optimizers = []
    dense = [g for g, flag in zip(groups, is_sparse) if not flag]
    if dense:
        optimizers.append(torch.optim.AdamW(dense, fused=True, **kwargs))
    sparse = [g for g, flag in zip(groups, is_sparse) if flag]
    if sparse:
        if config.memory.value_optimizer == "sparse_adam":
            values = SparseAdam(sparse, **kwargs)
        else:
            values = RowWiseAdagrad(sparse, lr=t.lr, eps=t.adam_eps)
        if config.memory.fused_value_optimizer:
            attach_fused_updates([p for g in sparse for p in g["params"]], values)
        optimizers.append(values)
    return optimizers


class Optimizers:
    """megatron's optimizer of the dense parameters (``dense``) and the memory tables' own
    (``tables``), stepped as one: ``param_groups`` is theirs concatenated (the LR scheduler sets
    each group's ``lr``); ``state[p]`` is a table's state. ``model_has_tables``: whether any
    pipeline stage holds tables (a rank of a stage without any still joins their norm's sum).
    megatron's ChainedOptimizer chains only megatron optimizers, hence this class."""

    def __init__(self, dense, tables: List[torch.optim.Optimizer], model_has_tables: bool = True):
        self.dense = dense
        self.tables = tables
        self.model_has_tables = model_has_tables
        self._owner: Dict[torch.nn.Parameter, torch.optim.Optimizer] = {
            p: o for o in tables for g in o.param_groups for p in g["params"]
        }

    @property
    def dense_optimizers(self) -> list:
        """megatron's optimizers (dense, and expert-parallel experts where there are any)."""
        return list(getattr(self.dense, "chained_optimizers", [self.dense]))

    @property
    def param_groups(self) -> List[dict]:
        return self.dense.param_groups + [g for o in self.tables for g in o.param_groups]

    def owner(self, p: torch.nn.Parameter) -> torch.optim.Optimizer:
        """The tables' optimizer that steps table ``p``."""
        return self._owner[p]

    @property
    def state(self) -> _TableState:
        return _TableState(self._owner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        for o in self.tables:
            o.zero_grad(set_to_none=set_to_none)
        for cache in self._caches():
            cache.grad = None

    def _caches(self) -> list:
        """The device caches of the host tables (``memory.host_cache_rows``)."""
        return [host_cache(p) for p in self._owner if host_cache(p) is not None]

    def prepare_grads(self) -> None:
        """megatron's gradients into its main parameters (their shards with the distributed
        optimizer); a local table's DDP gradient into ``.grad``, rounded once to its dtype (a
        bf16 table, ``memory.value_dtype``)."""
        self.dense.prepare_grads()
        for p in self._owner:
            if not self_reduced(p) and getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)

    def grads(self) -> List[torch.Tensor]:
        """Every gradient the step applies (megatron's main gradients, the tables', a host table's
        cached rows')."""
        out = [g for o in self.dense_optimizers for g in _main_grads(o)]
        out += [c.grad for c in self._caches() if c.grad is not None]
        return out + [p.grad for p in self._owner if p.grad is not None]

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared global L2 norm of the step's gradients, each TP-duplicated parameter counted
        once: megatron's main gradients over each optimizer's gradient-statistics group (the
        model-parallel group; the whole world with the distributed optimizer, whose shards are
        distinct; for expert-parallel experts their expert group), and where the model has tables
        theirs by :func:`~rmt.memory.groups.memory_grad_sq_norm`. The same collectives on every
        rank, whichever tables its pipeline stage holds. A one-element fp64 tensor on the compute
        device: nothing here waits for it."""
        norm_sq = torch.zeros(1, dtype=torch.float64, device=compat.device())
        for o in self.dense_optimizers:
            norm_sq += grad_sq_norm(o.get_main_grads_for_grad_norm(), o.get_grad_stats_parallel_group())
        if not self.model_has_tables:
            return norm_sq
        return norm_sq + memory_grad_sq_norm(list(self._owner))

    def clip(self, max_norm: float, norm: float) -> None:
        """Scale every gradient by ``max_norm / norm`` where ``norm`` exceeds ``max_norm``."""
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            grads = self.grads()
            torch._foreach_mul_([g for g in grads if not g.is_sparse], scale)
            for g in grads:
                if g.is_sparse:
                    g.mul_(scale)

    def step(self) -> None:
        """The host-memory tables' steps launched on their thread
        (:func:`~rmt.memory.host_steps.launch_host_steps`), megatron's step (and its copy to, or
        all-gather of, the model parameters) beside them, then the other tables'."""
        launched = [launch_host_steps(o) for o in self.tables]
        self.dense.step_with_ready_grads()
        for o, host in zip(self.tables, launched):
            with held_back(host):
                o.step()


def _main_grads(optimizer) -> List[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class _TableState:
    def __init__(self, owner):
        self.owner = owner

    def __getitem__(self, p):
        return self.owner[p].state[p]

    def __contains__(self, p) -> bool:
        return p in self.owner and p in self.owner[p].state

    def get(self, p, default=None):
        return self[p] if p in self else default


def build_optimizer(chunks: List[torch.nn.Module], config: RMTConfig) -> Optimizers:
    """The run's :class:`Optimizers` over DDP-wrapped ``chunks``."""
    return Optimizers(
        build_dense_optimizer(chunks, config),
        build_table_optimizers(chunks, config),
        model_has_tables=config.memory.type in TABLE_TYPES,
    )


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
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.lr * t.min_lr_ratio,
        lr_warmup_steps=warmup_steps(config),
        lr_decay_steps=t.steps,
        lr_decay_style=t.lr_decay_style,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
    )


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
