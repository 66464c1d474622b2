"""CUDA backend: csrc/lookup_reduce_cuda_kernels.cu + its torch binding, JIT-built on first use."""

import torch

from ._build import load_extension

NAME = "rmt_lookup_reduce_cuda"


def _ext():
    return load_extension(NAME, ["lookup_reduce_cuda.cpp", "lookup_reduce_cuda_kernels.cu"],
                          extra_cflags=["-O3"], extra_cuda_cflags=["-O3"])


def is_available(device):
    """True for CUDA tensors when torch has CUDA and the extension builds."""
    return device.type == "cuda" and torch.cuda.is_available() and _ext() is not None


def forward(table, indices, scores, block_ids, num_blocks):
    return _ext().forward(table, indices, scores, block_ids, num_blocks)


def backward(grad_out, table, indices, scores, block_ids, num_blocks):
    return tuple(_ext().backward(grad_out, table, indices, scores, block_ids, num_blocks))
