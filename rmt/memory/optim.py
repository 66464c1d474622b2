"""Memory-value learning rate (UltraMem §3.2 item 3, §5.1): the values' LR is
``mult(t) x base_lr(t)`` with ``mult`` decaying linearly from ``memory.value_lr_mult`` at step 0
to 1 at the last step."""

from __future__ import annotations

from typing import List

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rmt.memory.descriptor import is_table


def value_lr_multiplier(step: int, total_steps: int, mult: float) -> float:
    """``mult`` at step 0, 1 at ``total_steps`` and after, linear in between."""
    frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
    return mult - (mult - 1.0) * frac


def split_value_group(groups: List[dict], mult: float) -> List[dict]:
    """Move the value tables' weights (:func:`~rmt.memory.descriptor.is_table`) into their own
    group (no weight decay, like embeddings) carrying ``value_lr_mult``."""
    values = [p for g in groups for p in g["params"] if is_table(p)]
    if not values:
        return groups
    ids = {id(p) for p in values}
    out = [dict(g, params=[p for p in g["params"] if id(p) not in ids]) for g in groups]
    out = [g for g in out if g["params"]]
    out.append({"params": values, "weight_decay": 0.0, "wd_mult": 0.0, "value_lr_mult": mult})
    return out


class ValueLRScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler; groups with ``value_lr_mult`` get the decaying multiplier."""

    def get_lr(self, param_group: dict) -> float:
        lr = super().get_lr(param_group)
        mult = param_group.get("value_lr_mult")
        if mult is None:
            return lr
        return lr * value_lr_multiplier(self.num_steps, self.lr_decay_steps, mult)
