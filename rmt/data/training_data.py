"""The training loop's one view of its data (:class:`TrainingData`): the train and validation
samples (the corpus through :mod:`rmt.data.gpt_data`, or a synthetic task of
:mod:`rmt.data.tasks`), the micro-batches of a global batch, the task curriculum's reaction to an
evaluation, and what a checkpoint keeps of them."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from rmt.config import RMTConfig
from rmt.data.gpt_data import build_datasets, microbatches, resolve_data
from rmt.data.metadata import tokenizer_file_text
from rmt.data.tasks import build_task_datasets, curriculum_hook


class TrainingData:
    """The samples of a run of ``config``: ``train_samples`` for training and
    ``valid_samples`` for validation (each global batch of ``global_batch`` samples), read by
    data-parallel rank ``dp_rank`` of ``dp_size``. Data problems raise ``UserError`` here, before
    any step runs."""

    def __init__(
        self, config: RMTConfig, train_samples: int, valid_samples: int, global_batch: int, dp_rank: int, dp_size: int
    ):
        self.config = config
        self.dp_rank, self.dp_size = dp_rank, dp_size
        if config.data.task != "none":
            self.train_ds, self.valid_ds = build_task_datasets(config, train_samples, valid_samples, global_batch)
        else:
            self.train_ds, self.valid_ds = build_datasets(config, resolve_data(config), train_samples, valid_samples)
        self._curriculum = curriculum_hook(config)

    def batches(
        self, split: str, first_sample: int, micro_batch_size: int, num_microbatches: int
    ) -> List[Dict[str, torch.Tensor]]:
        """This rank's micro-batches of the ``split`` (``train`` or ``valid``) global batch that
        starts at sample ``first_sample``."""
        dataset = self.train_ds if split == "train" else self.valid_ds
        return microbatches(dataset, first_sample, micro_batch_size, num_microbatches, self.dp_rank, self.dp_size)

    def after_evaluation(self, metrics: Dict) -> Tuple[bool, bool]:
        """React to ``metrics["val_loss"]``: the task curriculum may lengthen the samples from
        the next step (recording ``noise_length`` in ``metrics``). Returns whether the samples
        changed and whether they are at their final form (always, without a curriculum)."""
        if self._curriculum is None:
            return False, True
        before = self.train_ds.noise_length
        self._curriculum(self.train_ds, self.valid_ds, metrics)
        now = self.train_ds.noise_length
        return now != before, now >= self.config.data.curriculum_target

    def state_dict(self) -> Optional[dict]:
        """What a checkpoint keeps for the samples to resume as they were (a curriculum's noise
        length), or None when the position in the data is all there is."""
        return self.train_ds.state_dict() if hasattr(self.train_ds, "state_dict") else None

    def load_state_dict(self, state: dict) -> None:
        for ds in (self.train_ds, self.valid_ds):
            if hasattr(ds, "load_state_dict"):
                ds.load_state_dict(state)

    def tokenizer_json(self) -> Optional[str]:
        """The tokenizer file's contents for a checkpoint to carry (None for the byte tokenizer)."""
        return tokenizer_file_text(self.config.data.tokenizer)
