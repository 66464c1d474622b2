"""CPU backend: the OpenMP C++ kernels of csrc/lookup_reduce_*_cpu.cpp, bound in csrc/lookup_reduce_cpu.cpp
(built by :mod:`rmt.ops.extensions`)."""

from .extensions import load_extension
from .row_step import RowStep

NAME = "rmt_lookup_reduce_cpu"


def _ext():
    return load_extension(NAME)


def is_available(device):
    """True for CPU tensors once the extension builds."""
    return device.type == "cpu" and _ext() is not None


def forward(table, indices, scores, block_ids, num_blocks):
    return _ext().forward(table, indices, scores, block_ids, num_blocks)


def backward(grad_out, table, indices, scores, block_ids, num_blocks):
    return tuple(_ext().backward(grad_out, table, indices, scores, block_ids, num_blocks))


def backward_dense(grad_out, table, indices, scores, block_ids, num_blocks):
    """(dense [N, D] table gradient, score gradients), written in one pass without a [U, D] buffer."""
    return tuple(_ext().backward_dense(grad_out, table, indices, scores, block_ids, num_blocks))


def score_gradients(grad_out, table, indices, scores, block_ids, num_blocks):
    """[T, K, C] score gradients alone (no table gradient)."""
    return _ext().score_gradients(grad_out, table, indices, scores, block_ids, num_blocks)


def backward_update(
    grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update: RowStep
):
    """The backward with the optimizer step ``update`` fused in (:mod:`rmt.ops.fused_update`):
    (score gradients of tokens ``[score_first, score_first + score_tokens)``, squared norm of the
    scaled table gradient)."""
    return tuple(
        _ext().backward_update(
            grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, *update.arguments()
        )
    )
