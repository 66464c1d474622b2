"""Triton kernels of the fused lookup-reduce (imported only when Triton is used).

Forward: one program per (token, virtual block); it walks the token's K lookups, loads the
rows whose block id matches, and accumulates ``score[col // (D/C)] * row`` in fp32 over a
padded power-of-two lane vector (any D works through masking). Every operand is converted to
fp32 on load and every result rounded once to its pointer's dtype on store, so a table stored
narrower than the scores (bf16 with fp32 scores) changes nothing but those conversions.

Backward: lookups are sorted by row (stable) and segmented on the device, so each program owns
one unique row and sums its contributions in position order: no atomics, bit-identical table
gradients. The grid covers all M lookups, programs past the unique-row count U (read on the
device) do nothing, so no host sync is needed to launch it. Each program writes its gradient
row to the compact [U, D] buffer or straight into the dense [N, D] gradient, and computes the
score gradients of the lookups it owns, reading the table row once.
"""

import triton
import triton.language as tl


@triton.jit
def lookup_reduce_fwd_kernel(table, indices, scores, block_ids, out, K, D, E, DC,
                             C: tl.constexpr, HAS_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    col = d // DC
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(K):
        p = t * K + k
        row = tl.load(indices + p)
        if HAS_BLOCKS:
            # The block id is loaded as a broadcast vector: the interpreter rejects a mask
            # built from a scalar comparison.
            m = dmask & (tl.load(block_ids + p + tl.zeros([BLOCK_D], dtype=tl.int64)) == b)
        else:
            m = dmask
        s = tl.load(scores + p * C + col, mask=m, other=0.0).to(tl.float32)
        v = tl.load(table + row * D + d, mask=m, other=0.0).to(tl.float32)
        acc += s * v
    tl.store(out + (t * E + b) * D + d, acc.to(out.dtype.element_ty), mask=dmask)


@triton.jit
def lookup_reduce_bwd_kernel(grad_out, table, scores, block_ids, sorted_pos, seg_start, rows, num_unique,
                             dst, grad_scores, K, D, E, DC,
                             C: tl.constexpr, HAS_BLOCKS: tl.constexpr, DENSE: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    start = tl.load(seg_start + u)
    end = tl.load(seg_start + u + 1)
    row = tl.load(rows + u)
    d = tl.arange(0, BLOCK_D)
    # u < U as a lane vector: the interpreter rejects a mask built from a scalar comparison.
    dmask = d < D
    valid = dmask & ((u + tl.zeros([BLOCK_D], dtype=tl.int64)) < tl.load(num_unique))
    col = d // DC
    trow = tl.load(table + row * D + d, mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(start, end):
        p = tl.load(sorted_pos + j)
        t = p // K
        if HAS_BLOCKS:
            b = tl.load(block_ids + p)
        else:
            b = 0
        g = tl.load(grad_out + (t * E + b) * D + d, mask=dmask, other=0.0).to(tl.float32)
        s = tl.load(scores + p * C + col, mask=dmask, other=0.0).to(tl.float32)
        acc += s * g
        prod = trow * g
        for c in tl.static_range(C):
            dot = tl.sum(tl.where(col == c, prod, 0.0), axis=0)
            tl.store(grad_scores + p * C + c, dot.to(grad_scores.dtype.element_ty))
    if DENSE:
        out = dst + row * D
    else:
        out = dst + u * D
    tl.store(out + d, acc.to(dst.dtype.element_ty), mask=valid)
