"""The arguments of the row optimizer's step that every backend's ``backward_update`` fuses into
the lookup-reduce backward (:mod:`rmt.ops.fused_update`), as one record."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .optimizer_codes import SPARSE_ADAM


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One step of a row-wise optimizer (:mod:`rmt.ops.sparse_optim`) on the rows a backward touches.

    ``optimizer``: :data:`~rmt.ops.optimizer_codes.SPARSE_ADAM` or
    :data:`~rmt.ops.optimizer_codes.ROWWISE_ADAGRAD`; ``state1``, ``state2``: Adam's two moments
    (``exp_avg``, ``exp_avg_sq``), or Adagrad's per-row sums and None; ``lr``, ``beta1``,
    ``beta2``, ``eps``, ``weight_decay``: the param group's hyper-parameters (Adam's betas 0 for
    Adagrad, Adagrad's decay 0 for Adam); ``step``: Adam's step count after this step (0 for
    Adagrad); ``grad_scale``: the factor of the summed row gradient (the data-parallel mean's
    ``1 / DP``, negated to maximise)."""

    optimizer: int
    state1: torch.Tensor
    state2: Optional[torch.Tensor]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    grad_scale: float

    @property
    def adam(self) -> bool:
        return self.optimizer == SPARSE_ADAM

    @property
    def rate(self) -> float:
        """The step size the kernels take: Adam's bias-corrected ``lr sqrt(1 - beta2^t) / (1 -
        beta1^t)`` (Kingma & Ba, Algorithm 1's efficient form, as in the unfused step), Adagrad's
        ``lr``."""
        if not self.adam:
            return self.lr
        return self.lr * math.sqrt(1 - self.beta2**self.step) / (1 - self.beta1**self.step)

    def arguments(self) -> tuple:
        """The fields in order, as the extensions' ``backward_update`` takes them (the tensors
        themselves, not copies)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))
