"""CUDA backend of the fused retrieval op (:mod:`rmt.ops.fused_retrieval`): the selection of
csrc/retrieval_select_cuda_kernels.cu and its torch binding csrc/retrieval_select_cuda.cpp (built
by :mod:`rmt.ops.extensions`). Inputs: float32 or bfloat16."""

import torch

from .extensions import load_extension

NAME = "rmt_retrieval_select_cuda"


def _ext():
    return load_extension(NAME)


def is_available(device):
    """True for CUDA tensors when torch has CUDA and the extension builds."""
    return device.type == "cuda" and torch.cuda.is_available() and _ext() is not None


def select(q_row, q_col, keys, m, selector=None, key_tile=None, token_block=None):
    """The contract of :func:`rmt.ops.retrieval_reference.select` (the selector in float32, the
    accumulation dtype). The kernels' tiles are fixed (32 tokens per block, a shared-memory tile of
    keys): ``key_tile`` and ``token_block`` are accepted and change nothing."""
    core, u, t = (x.float() for x in selector) if selector is not None else (None, None, None)
    return tuple(_ext().select(q_row, q_col, keys, m, core, u, t))
