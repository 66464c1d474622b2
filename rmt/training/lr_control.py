"""The learning rate's response to validation: a factor on the whole schedule that falls when a
synthetic-task curriculum doubles its noise length (``train.lr_curriculum_decay``, and
``train.lr_target_decay`` more at the doubling that reaches the target) and when the
validation loss stops improving (``train.lr_plateau_decay`` after ``train.lr_plateau_patience``
evaluations, judged on the loss's moving average when ``train.lr_plateau_smoothing`` > 0), never
below ``train.min_lr_ratio``.

"Efficient LLM Architectures" §6.2 trains copy and selective copy with a curriculum during which
"the learning rate decays as a function of the sequence length and the validation loss", without
the function; these two rules are that, in the simplest form. With a curriculum the plateau rule
waits for the noise length to reach ``data.curriculum_target``: before it the curriculum's
doublings mark progress, and a stage's loss often sits level for hundreds of steps before it
falls. The trainer applies the factor through :class:`rmt.training.optimizer.ScaledLRScheduler`
and keeps :meth:`ValidationLR.state_dict` in its checkpoints.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from rmt.config import RMTConfig


class ValidationLR:
    """``update`` after each evaluation; ``scale`` is the factor on the scheduled learning rate."""

    def __init__(self, config: RMTConfig):
        t = config.train
        self.curriculum_decay = t.lr_curriculum_decay
        self.target_decay = t.lr_target_decay
        self.plateau_decay = t.lr_plateau_decay
        self.patience = t.lr_plateau_patience
        self.smoothing = t.lr_plateau_smoothing
        self.floor = t.min_lr_ratio
        self.scale = 1.0
        self.smoothed = None  # the moving average of the validation loss at the current noise length
        self.best = math.inf  # its lowest value (each evaluation alone when smoothing is 0)
        self.waited = 0  # evaluations since ``best`` fell or the last reduction

    def update(self, val_loss: float, advanced: bool, at_target: bool) -> float:
        """Record one evaluation: ``advanced`` when the curriculum has just doubled the noise
        length, ``at_target`` when the plateau rule applies (the noise length is at the
        curriculum's target, or there is no curriculum). Returns the new ``scale``."""
        if advanced:
            self.scale *= self.curriculum_decay * (self.target_decay if at_target else 1.0)
            self.smoothed, self.best, self.waited = None, math.inf, 0
        elif at_target:
            if self.smoothed is None:
                self.smoothed = val_loss
            else:
                self.smoothed = self.smoothing * self.smoothed + (1.0 - self.smoothing) * val_loss
            if self.smoothed < self.best:
                self.best, self.waited = self.smoothed, 0
            else:
                self.waited += 1
                if self.waited >= self.patience:
                    self.scale *= self.plateau_decay
                    self.waited = 0
        self.scale = max(self.scale, self.floor)
        return self.scale

    def state_dict(self) -> Dict[str, Optional[float]]:
        return {"scale": self.scale, "smoothed": self.smoothed, "best": self.best, "waited": self.waited}

    def load_state_dict(self, state: Dict[str, Optional[float]]) -> None:
        self.scale, self.best, self.waited = float(state["scale"]), float(state["best"]), int(state["waited"])
        self.smoothed = state.get("smoothed")  # absent from checkpoints older than the smoothing
