"""CPU backend of the fused retrieval op (:mod:`rmt.ops.fused_retrieval`): the OpenMP C++ selection
of csrc/retrieval_select_cpu.cpp (built by :mod:`rmt.ops.extensions`)."""

import torch

from rmt.retrieval_backends import CPU_KEY_TILE, CPU_TOKEN_BLOCK

from .extensions import load_extension

NAME = "rmt_retrieval_select_cpu"


def _ext():
    return load_extension(NAME)


def is_available(device):
    """True for CPU tensors once the extension builds."""
    return device.type == "cpu" and _ext() is not None


def select(q_row, q_col, keys, m, selector=None, key_tile=None, token_block=None):
    """The contract of :func:`rmt.ops.retrieval_reference.select` (the selector widened to the
    accumulation dtype, exactly, as the reference widens it)."""
    acc = torch.float64 if keys.dtype == torch.float64 else torch.float32
    core, u, t = (x.to(acc) for x in selector) if selector is not None else (None, None, None)
    return tuple(
        _ext().select(q_row, q_col, keys, m, core, u, t, key_tile or CPU_KEY_TILE, token_block or CPU_TOKEN_BLOCK)
    )
