"""Synthetic long-range tasks and the noise-length curriculum ("Efficient LLM Architectures"
§6.2, after Gu & Dao's copy and selective copy).

Alphabet of ``A = data.task_alphabet`` symbols: ids ``0 .. A-3`` are data, ``A-2`` is the noise
token, ``A-1`` the recall token. With ``n = data.task_tokens`` and ``N`` noise tokens a sample is
``n + N + n`` tokens long:

* ``copy``: ``n`` data tokens, ``N`` noise tokens, ``n`` recall tokens.
* ``selective_copy``: the ``n`` data tokens at random positions (kept in order) of a prefix of
  ``n + N`` tokens that is otherwise noise, then ``n`` recall tokens.

The target at the ``j``-th recall token is the ``j``-th data token; only the recall positions
carry loss (``loss_mask``). Samples are a pure function of (seed, split, index, N).

With ``data.noise_min_fraction < 1`` each training step (global batch) draws its noise length
from ``ceil(f N) .. N`` in steps of ``data.noise_mix_step`` below ``N`` (once ``N`` reaches
``data.noise_mix_from``), a pure function of (seed, N, step's first sample).

Curriculum (§6.2): start with ``data.noise_length`` noise tokens; after an evaluation whose
validation loss is below ``data.curriculum_threshold`` double ``N`` (capped at
``data.curriculum_target``). ``model.seq_length`` must hold the longest sample.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, Optional, Tuple

import torch

from rmt.config import RMTConfig
from rmt.errors import ConfigError

_SPLITS = {"train": 0, "valid": 1}


def noise_token(alphabet: int) -> int:
    return alphabet - 2


def recall_token(alphabet: int) -> int:
    return alphabet - 1


def make_sample(
    task: str, generator: torch.Generator, tokens: int, alphabet: int, noise_length: int
) -> Dict[str, torch.Tensor]:
    """One sample: ``tokens``, ``labels`` and ``loss_mask`` ``[2n + N]``, ``position_ids``."""
    n = tokens
    data = torch.randint(0, alphabet - 2, (n,), generator=generator)
    prefix = torch.full((n + noise_length,), noise_token(alphabet), dtype=torch.long)
    if task == "copy":
        prefix[:n] = data
    else:
        where = torch.randperm(n + noise_length, generator=generator)[:n].sort().values
        prefix[where] = data
    seq = torch.cat([prefix, torch.full((n,), recall_token(alphabet), dtype=torch.long)])
    labels = torch.zeros_like(seq)
    labels[-n:] = data
    loss_mask = torch.zeros(seq.shape, dtype=torch.float32)
    loss_mask[-n:] = 1.0
    return {"tokens": seq, "labels": labels, "loss_mask": loss_mask, "position_ids": torch.arange(seq.numel())}


class TaskDataset:
    """Map-style dataset of ``size`` samples; ``noise_length`` may change between batches."""

    def __init__(self, config: RMTConfig, split: str, size: int, global_batch: int = 1):
        d = config.data
        self.task, self.tokens, self.alphabet = d.task, d.task_tokens, d.task_alphabet
        self.noise_length = d.noise_length
        self.min_fraction = d.noise_min_fraction if split == "train" else 1.0
        self.mix_step, self.mix_from = d.noise_mix_step, d.noise_mix_from
        self.global_batch = global_batch
        self.seed = config.train.seed * 4 + _SPLITS[split]
        self.size = size

    def __len__(self) -> int:
        return self.size

    def state_dict(self) -> Dict[str, int]:
        """What a checkpoint must keep for the curriculum to resume where it was."""
        return {"noise_length": self.noise_length}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.noise_length = int(state["noise_length"])

    def step_noise_length(self, index: int) -> int:
        """The noise length of the step (global batch) that holds sample ``index``."""
        low = math.ceil(self.min_fraction * self.noise_length)
        if low >= self.noise_length or self.noise_length < self.mix_from:
            return self.noise_length
        choices = (self.noise_length - low) // self.mix_step + 1
        step = index // self.global_batch
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{self.noise_length}:mix:{step}".encode()))
        below = choices - 1 - int(torch.randint(choices, (1,), generator=gen))
        return self.noise_length - self.mix_step * below

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        key = f"{self.seed}:{self.noise_length}:{index}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key) * 65_537 + index)
        return make_sample(self.task, gen, self.tokens, self.alphabet, self.step_noise_length(index))


def validate_task(config: RMTConfig) -> None:
    """Reject task settings that cannot work together (ConfigError); reads ``config`` only."""
    d, m = config.data, config.model
    target = d.curriculum_target if d.curriculum_target is not None else d.noise_length
    if target < d.noise_length:
        raise ConfigError(f"data.curriculum_target ({target}) is below data.noise_length ({d.noise_length})")
    if (d.curriculum_threshold is None) != (d.curriculum_target is None):
        raise ConfigError("set both data.curriculum_threshold and data.curriculum_target, or neither")
    longest = 2 * d.task_tokens + target
    if m.seq_length < longest:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must hold the longest task sample "
            f"2 x data.task_tokens + {target} noise tokens = {longest}"
        )
    if m.vocab_size is not None and m.vocab_size < d.task_alphabet:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than data.task_alphabet ({d.task_alphabet})")


def build_task_datasets(
    config: RMTConfig, num_train: int, num_valid: int, global_batch: int
) -> Tuple[TaskDataset, TaskDataset]:
    """Training and validation datasets; ``global_batch`` samples make one step (the unit that
    shares a noise length under ``data.noise_min_fraction``). Fills an unset ``model.vocab_size``
    with the task's alphabet, as :func:`rmt.data.resolution.resolve_from_data` does."""
    validate_task(config)
    if config.model.vocab_size is None:
        config.model.vocab_size = config.data.task_alphabet
    return (
        TaskDataset(config, "train", num_train, global_batch),
        TaskDataset(config, "valid", max(num_valid, 1), global_batch),
    )


def curriculum_hook(config: RMTConfig) -> Optional[Callable]:
    """``hook(train_ds, valid_ds, metrics)`` to call after each evaluation, or None without a
    curriculum. It records ``noise_length`` in ``metrics`` and doubles it (in both datasets) once
    validation loss is low."""
    d = config.data
    if d.task == "none" or d.curriculum_threshold is None:
        return None

    def hook(train_ds: TaskDataset, valid_ds: TaskDataset, metrics: Dict) -> None:
        current = train_ds.noise_length
        if metrics["val_loss"] < d.curriculum_threshold and current < d.curriculum_target:
            current = min(max(2 * current, 1), d.curriculum_target)
            train_ds.noise_length = valid_ds.noise_length = current
        metrics["noise_length"] = current

    return hook


def recall_accuracy(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, alphabet: int) -> float:
    """Fraction of recall positions whose argmax over the task alphabet is the target."""
    pred = logits[..., :alphabet].argmax(-1)
    hits = ((pred == labels).float() * loss_mask).sum()
    return float(hits / loss_mask.sum())
