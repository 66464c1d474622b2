"""Where megatron-core's optimizers keep each dense parameter's state, for checkpoints.

A checkpoint stores a dense parameter's Adam moments (and, where the optimizer keeps one apart,
its fp32 main copy) as shards of the parameter's own global tensor, whichever optimizer held
them, so that a checkpoint reshards to any TP / PP / DP layout and between the plain and the
distributed optimizer. megatron's optimizers hold that state three ways:

* ``FP32Optimizer``: keyed by the model parameter itself, which is its own main copy;
* the float16 optimizer (bf16 parameters): keyed by an fp32 main copy of each bf16 parameter;
* ``DistributedOptimizer``: keyed by the fp32 main copy of this rank's range of the
  parameter's flattened elements (ZeRO-1), which may be empty.

megatron's own ``sharded_state_dict`` of these optimizers names their tensors by its param-group
order and writes the distributed one under other keys than the plain one; this module gives
each parameter's tensors with the range they cover, and :mod:`rmt.training.checkpoint` names
them by the parameter's checkpoint key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from megatron.core.optimizer import DistributedOptimizer, FP32Optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class DenseState:
    """The optimizer state of one model parameter on this rank."""

    tensors: Dict[str, torch.Tensor]  # exp_avg, exp_avg_sq, and main_param where it is a copy
    flat_range: Optional[slice]  # the elements of the flattened parameter covered; None: all
    main: torch.Tensor  # the tensor the optimizer steps (its .grad is the step's gradient)


def dense_states(dense_optimizers: List) -> Dict[torch.nn.Parameter, DenseState]:
    """Every model parameter with optimizer state on this rank (state created by the caller)."""
    out: Dict[torch.nn.Parameter, DenseState] = {}
    for opt in dense_optimizers:
        if opt.optimizer is None:  # a stage without trainable parameters of this kind
            continue
        state = opt.optimizer.state
        if isinstance(opt, DistributedOptimizer):
            for per_dtype in opt.gbuf_ranges:
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for model_param, ranges in bucket["param_map"].items():
                            group, order = opt.model_param_group_index_map[model_param]
                            main = opt.optimizer.param_groups[group]["params"][order]
                            r = ranges["param"]
                            out[model_param] = DenseState(
                                _tensors(state[main], main, model_param), slice(r.start, r.end), main
                            )
        elif isinstance(opt, FP32Optimizer):
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    out[p] = DenseState(_tensors(state[p], p, p), None, p)
        else:  # Float16OptimizerWithFloat16Params
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(models, mains):
                    out[p] = DenseState(_tensors(state[main], main, p), None, main)
            for group in opt.fp32_from_fp32_groups:
                for p in group:
                    out[p] = DenseState(_tensors(state[p], p, p), None, p)
    return out


def _tensors(state: dict, main: torch.Tensor, model_param: torch.Tensor) -> Dict[str, torch.Tensor]:
    tensors = {name: state[name] for name in MOMENTS if name in state}
    if main.dtype != model_param.dtype:
        tensors["main_param"] = main
    return tensors


def inner_optimizers(optimizers) -> List[torch.optim.Optimizer]:
    """The torch optimizers under :class:`rmt.training.optimizer.Optimizers` (megatron's inner
    ones and the tables')."""
    inner = [o.optimizer for o in optimizers.dense_optimizers if o.optimizer is not None]
    return inner + list(optimizers.tables)


def optimizer_bytes(optimizers) -> int:
    """Bytes this rank's optimizers hold: every state tensor and every main copy that is not a
    model parameter (megatron's fp32 copies of bf16 parameters, or their shards)."""
    total, seen = 0, set()
    for dense in optimizers.dense_optimizers:
        for state in dense_states([dense]).values():
            if "main_param" in state.tensors:
                total += state.main.numel() * state.main.element_size()
    for inner in inner_optimizers(optimizers):
        for state in inner.state.values():
            for t in state.values():
                if torch.is_tensor(t) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total
