"""The vocabulary the models build, torch-free (the planner and the start-up checks count it)."""

from __future__ import annotations


def padded_vocab_size(config) -> int:
    """``model.vocab_size`` padded to a multiple of ``model.make_vocab_size_divisible_by`` (kept
    independent of the TP size so that every parallel layout has the same embedding table)."""
    multiple = config.model.make_vocab_size_divisible_by
    return -(-config.model.vocab_size // multiple) * multiple
