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
def lookup_reduce_fwd_kernel(
    table,
    indices,
    scores,
    block_ids,
    out,
    K,
    D,
    E,
    DC,
    C: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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
def lookup_reduce_bwd_kernel(
    grad_out,
    table,
    scores,
    block_ids,
    sorted_pos,
    seg_start,
    rows,
    num_unique,
    dst,
    grad_scores,
    K,
    D,
    E,
    DC,
    C: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
    DENSE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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


@triton.jit
def lookup_reduce_bwd_update_kernel(
    grad_out,
    table,
    scores,
    block_ids,
    sorted_pos,
    seg_start,
    rows,
    num_unique,
    grad_scores,
    score_lo,
    score_hi,
    state1,
    state2,
    row_sq,
    K,
    D,
    E,
    DC,
    grad_scale,
    lr,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    weight_decay,
    C: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
    ADAM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The backward with the optimizer fused in (rmt.ops.fused_update): as
    lookup_reduce_bwd_kernel, with score gradients for positions in [score_lo, score_hi) only,
    then the row's gradient (times grad_scale) steps the row in place: SparseAdam (ADAM; ``lr`` is
    the bias-corrected step size, state1/state2 the fp32 moments) or row-wise Adagrad (state1 the
    fp32 per-row sums). Every operation rounded on its own (launched with enable_fp_fusion=False,
    IEEE division and square root), as the unfused Triton step. row_sq[u]: the row's squared
    gradient norm."""
    u = tl.program_id(0).to(tl.int64)
    start = tl.load(seg_start + u)
    end = tl.load(seg_start + u + 1)
    row = tl.load(rows + u)
    d = tl.arange(0, BLOCK_D)
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
        # p in [score_lo, score_hi) as a lane vector (the interpreter rejects scalar masks)
        pv = p + tl.zeros([BLOCK_D], dtype=tl.int64)
        keep = (pv >= score_lo) & (pv < score_hi) & (d == 0)
        for c in tl.static_range(C):
            dot = tl.sum(tl.where(col == c, prod, 0.0), axis=0)
            tl.store(
                grad_scores + (pv - score_lo) * C + c,
                (dot + tl.zeros([BLOCK_D], dtype=tl.float32)).to(grad_scores.dtype.element_ty),
                mask=keep,
            )
    g = acc * grad_scale
    g = tl.where(valid, g, 0.0)
    tl.store(
        row_sq + u + tl.zeros([BLOCK_D], dtype=tl.int64),
        tl.sum(g * g, axis=0) + tl.zeros([BLOCK_D], dtype=tl.float32),
        mask=valid & (d == 0),
    )
    off = row * D + d
    if ADAM:
        m = tl.load(state1 + off, mask=valid, other=0.0)
        v = tl.load(state2 + off, mask=valid, other=0.0)
        m = m + (g - m) * one_minus_beta1
        v = v + (g * g - v) * one_minus_beta2
        new = trow - lr * tl.div_rn(m, tl.sqrt_rn(v) + eps)
        tl.store(state1 + off, m, mask=valid)
        tl.store(state2 + off, v, mask=valid)
    else:
        gw = tl.where(weight_decay != 0.0, g + weight_decay * trow, g)  # no term at 0 (row_optim.h, NoDecay)
        sq = tl.sum(tl.where(valid, gw * gw, 0.0), axis=0)
        rv = row + tl.zeros([BLOCK_D], dtype=tl.int64)
        first = valid & (d == 0)
        total = tl.load(state1 + rv, mask=valid, other=0.0) + tl.div_rn(sq, D * 1.0)
        tl.store(state1 + rv, total, mask=first)
        new = trow - tl.div_rn(lr + tl.zeros([BLOCK_D], dtype=tl.float32), tl.sqrt_rn(total) + eps) * gw
    tl.store(table + off, new.to(table.dtype.element_ty), mask=valid)
