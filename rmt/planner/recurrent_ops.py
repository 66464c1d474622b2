"""Ops per sample of a regular and a recurrent transformer ("Efficient LLM Architectures" §5.1).

``r`` layers, embedding dimension ``d``, sequence length ``l``, block width ``k``. A regular
layer costs ``l^2 d`` (attention) + ``l d^2`` (projections); a recurrent layer sees every token
twice, in windows of ``2k`` tokens: ``4 d l k + 2 l d^2``. These are the paper's "Ops/sample"
columns (Tables 2, 4 and 6), not multiply-add-exact FLOP counts.
"""

from __future__ import annotations


def _check(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def transformer_ops_per_sample(layers: int, hidden: int, seq_length: int) -> int:
    """``r (l^2 d + l d^2)``."""
    _check(layers=layers, hidden=hidden, seq_length=seq_length)
    return layers * (seq_length**2 * hidden + seq_length * hidden**2)


def recurrent_ops_per_sample(layers: int, hidden: int, seq_length: int, block_width: int) -> int:
    """``r (4 d l k + 2 l d^2)``; ``block_width`` must not exceed ``seq_length``."""
    _check(layers=layers, hidden=hidden, seq_length=seq_length, block_width=block_width)
    if block_width > seq_length:
        raise ValueError(f"block width {block_width} exceeds the sequence length {seq_length}")
    return layers * (4 * hidden * seq_length * block_width + 2 * seq_length * hidden**2)
