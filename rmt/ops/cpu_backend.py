"""CPU backend: the OpenMP C++ kernels of csrc/lookup_reduce_cpu.cpp, JIT-built on first use."""

from ._build import load_extension

NAME = "rmt_lookup_reduce_cpu"


def _ext():
    # -ffp-contract=off: the fused optimizer step (csrc/row_optim.h) rounds every product and sum
    # on its own, as the separate step does; the kernels' own multiply-adds are explicit (madd)
    return load_extension(NAME, ["lookup_reduce_cpu.cpp"],
                          extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                          extra_ldflags=["-fopenmp"])


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


def backward_update(grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, optimizer,
                    state1, state2, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    """The backward with the optimizer step fused in (:mod:`rmt.ops.fused_update`): (score
    gradients of tokens ``[score_first, score_first + score_tokens)``, squared norm of the scaled
    table gradient)."""
    return tuple(_ext().backward_update(grad_out, table, indices, scores, block_ids, num_blocks, score_first,
                                        score_tokens, optimizer, state1, state2, lr, beta1, beta2, eps, weight_decay,
                                        step, grad_scale))
