"""Triton kernels of the fused retrieval's selection (:mod:`rmt.ops.retrieval_triton`; imported only
when Triton is used). The contract, tie rule and arithmetic are :mod:`rmt.ops.fused_retrieval`'s.

Ordered keys. A candidate is carried as one int64 whose order is the selection's: the high half
the score's float32 bits mapped to a signed integer of the same order (``-0.0`` as ``+0.0``), the
low half a tie-break in ``[0, 2^31)``. The top list's tie-break is ``2^31 - 1 - index`` (among
equal scores the lower index is the larger key), the bottom list's keys are those of ``-score``
with the index itself (among equal scores the higher index is the smaller score, the tie rule's
"last m of the order"). Keys are distinct, so the m largest keys are the selection, whatever the
order they were offered in, and no value travels beside them: the index decodes from the key.

Running lists. ``L [rows, M]`` holds the M largest keys seen so far in ascending order (``M`` the
power of two at or above m; its last m entries are the m best). A tile's keys ``[rows, W]`` (``W >=
M``) merge in only where one of them beats a row's smallest: the tile's top M (``tl.topk``,
descending) against ``L`` elementwise, the larger of each pair (the M largest of the union, as a
bitonic sequence), then a bitonic merge.
"""

import triton
import triton.language as tl

EMPTY = tl.constexpr(-(2**63))  # below every key of a float32 that is not NaN
LOW = tl.constexpr(2**31 - 1)


@triton.jit
def _ordered(v, low):
    """The int64 key of float32 scores ``v`` with tie-breaks ``low`` (module docstring)."""
    v = tl.where(v == 0.0, 0.0, v)
    b = v.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _low(key):
    """The tie-break half of ``key``."""
    return key - ((key >> 32) << 32)


@triton.jit
def _merge(L, tile, M: tl.constexpr):
    """``L [rows, M]`` (ascending) with the keys ``tile [rows, W]`` merged in: the M largest of
    both, ascending (module docstring)."""
    bound = tl.min(L, axis=1)
    if tl.max(tl.max((tile > bound[:, None]).to(tl.int32), axis=1), axis=0) > 0:
        L = tl.bitonic_merge(tl.maximum(L, tl.topk(tile, M)))
    return L


@triton.jit
def candidates_kernel(
    q,
    keys,
    weights,
    cand,
    T,
    H,
    n,
    D,
    m,
    c,
    side,
    sq0,
    sq1,
    sq2,
    R: tl.constexpr,
    TUCKER: tl.constexpr,
    FP32: tl.constexpr,
    WIDEN: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    M: tl.constexpr,
):
    """One program per (block of BT tokens, head) of grid side ``side``: streams the side's keys in
    tiles of BN, scores them (``q_a . k_a`` per rank, fp32 products rounded once to the inputs'
    dtype), keeps the top list of the scores (product keys) or the top and bottom lists of the
    rank-1 objective ``w_0 S_0 + w_1 S_1 + ...`` (TDQKR, Eq. 8-9), and writes each token's c
    candidate indices, ascending, to ``cand [T, H, 2, c]`` (int32)."""
    t0 = tl.program_id(0) * BT
    h = tl.program_id(1).to(tl.int64)
    rows = t0 + tl.arange(0, BT)
    d = tl.arange(0, BD)
    qmask = (rows[:, None] < T) & (d[None, :] < D)
    qbase = q + rows[:, None].to(tl.int64) * sq0 + h * sq1 + d[None, :]
    top = tl.full([BT, M], EMPTY, tl.int64)
    bottom = tl.full([BT, M], EMPTY, tl.int64)
    for j0 in range(0, n, BN):
        j = j0 + tl.arange(0, BN)
        kmask = (j[:, None] < n) & (d[None, :] < D)
        o = tl.zeros([BT, BN], tl.float32)
        for a in tl.static_range(R):
            qa = tl.load(qbase + a * sq2, mask=qmask, other=0.0)
            ka = tl.load(keys + (((h * 2 + side) * R + a) * n + j[:, None]) * D + d[None, :], mask=kmask, other=0.0)
            if WIDEN:  # the interpreter multiplies bfloat16 operands as their raw bits
                qa = qa.to(tl.float32)
                ka = ka.to(tl.float32)
            s = tl.dot(qa, tl.trans(ka), input_precision="ieee")
            if not FP32:  # rounded once to the inputs' dtype, as the unfused product is
                s = s.to(q.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
            if TUCKER:
                wa = tl.load(weights + h * R + a)
                if a == 0:
                    o = wa * s
                else:
                    o = o + wa * s
            else:
                o = s
        valid = (j < n)[None, :]
        top = _merge(top, tl.where(valid, _ordered(o, (-j + LOW)[None, :]), EMPTY), M)
        if TUCKER:
            bottom = _merge(bottom, tl.where(valid, _ordered(-o, j[None, :]), EMPTY), M)
    first = (tl.arange(0, M) >= M - m)[None, :]
    top_idx = tl.where(first, -_low(top) + LOW, LOW)
    if TUCKER:
        both = tl.reshape(tl.join(top_idx, tl.where(first, _low(bottom), LOW)), [BT, 2 * M])
        out = tl.sort(both, 1)
        p = tl.arange(0, 2 * M)
    else:
        out = tl.sort(top_idx, 1)
        p = tl.arange(0, M)
    dst = cand + ((rows[:, None].to(tl.int64) * H + h) * 2 + side) * c + p[None, :]
    tl.store(dst, out.to(tl.int32), mask=(rows[:, None] < T) & (p[None, :] < c))


@triton.jit
def candidate_scores_kernel(
    q_row,
    q_col,
    keys,
    cand,
    scores,
    H,
    n,
    D,
    c,
    sr0,
    sr1,
    sr2,
    sc0,
    sc1,
    sc2,
    R: tl.constexpr,
    FP32: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    """One program per (token, head, side, rank a) and block of BC candidates: the side scores
    ``q_a . k_a[j]`` of the candidates (fp32 products and sum, rounded once to the inputs' dtype),
    to ``scores [T, H, 2, R, c]`` (float32)."""
    pid = tl.program_id(0).to(tl.int64)
    a = pid % R
    side = (pid // R) % 2
    th = pid // (2 * R)
    t = th // H
    h = th % H
    e = tl.program_id(1) * BC + tl.arange(0, BC)
    d = tl.arange(0, BD)
    emask = e < c
    dmask = d < D
    idx = tl.load(cand + (th * 2 + side) * c + e, mask=emask, other=0).to(tl.int64)
    if side == 0:
        qv = tl.load(q_row + t * sr0 + h * sr1 + a * sr2 + d, mask=dmask, other=0.0)
    else:
        qv = tl.load(q_col + t * sc0 + h * sc1 + a * sc2 + d, mask=dmask, other=0.0)
    rows = tl.load(
        keys + (((h * 2 + side) * R + a) * n + idx[:, None]) * D + d[None, :],
        mask=emask[:, None] & dmask[None, :],
        other=0.0,
    )
    s = tl.sum(rows.to(tl.float32) * qv.to(tl.float32)[None, :], axis=1)
    if not FP32:
        s = s.to(qv.dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(scores + ((th * 2 + side) * R + a) * c + e, s, mask=emask)


@triton.jit
def _side(scores, th, side, a, i, mask, R: tl.constexpr, c):
    return tl.load(scores + ((th * 2 + side) * R + a) * c + i, mask=mask, other=0.0)


@triton.jit
def grid_topm_kernel(
    cand,
    scores,
    core,
    addr,
    sel,
    H,
    n,
    m,
    c,
    R: tl.constexpr,
    TUCKER: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    MP: tl.constexpr,
):
    """One program per (token, head): the exact top-m of the grid over both sides' candidates
    (ascending in index, so a grid position ``i * c + j`` orders as its address; the position is
    the tie-break), visited in tiles of BI x BJ: ``s_row + s_col`` (Eq. 3) or ``sum_b (sum_a
    s_row[a] C[a, b]) s_col[b]`` with the aggregated core (Eq. 10), each sum in order, fp32. Writes
    the addresses ``row * n + col`` best first to ``addr [T, H, m]`` and the side scores at them to
    ``sel [T, H, 2, R, m]`` (the inputs' dtype)."""
    th = tl.program_id(0).to(tl.int64)
    h = th % H
    best = tl.full([1, MP], EMPTY, tl.int64)
    for i0 in range(0, c, BI):
        i = i0 + tl.arange(0, BI)
        imask = i < c
        for j0 in range(0, c, BJ):
            j = j0 + tl.arange(0, BJ)
            jmask = j < c
            if TUCKER:
                g = tl.zeros([BI, BJ], tl.float32)
                for b in tl.static_range(R):
                    rv = tl.load(core + (h * R + 0) * R + b) * _side(scores, th, 0, 0, i, imask, R, c)
                    for a in tl.static_range(1, R):
                        rv = rv + tl.load(core + (h * R + a) * R + b) * _side(scores, th, 0, a, i, imask, R, c)
                    term = rv[:, None] * _side(scores, th, 1, b, j, jmask, R, c)[None, :]
                    if b == 0:
                        g = term
                    else:
                        g = g + term
            else:
                g = _side(scores, th, 0, 0, i, imask, R, c)[:, None] + _side(scores, th, 1, 0, j, jmask, R, c)[None, :]
            pos = i[:, None] * c + j[None, :]
            key = tl.where(imask[:, None] & jmask[None, :], _ordered(g, -pos + LOW), EMPTY)
            best = _merge(best, tl.reshape(key, [1, BI * BJ]), MP)
    k = tl.arange(0, MP)
    kmask = k < m
    pos = -_low(tl.reshape(tl.flip(best, 1), [MP])) + LOW
    pi = tl.where(kmask, pos // c, 0)
    pj = tl.where(kmask, pos % c, 0)
    ri = tl.load(cand + (th * 2 + 0) * c + pi, mask=kmask, other=0).to(tl.int64)
    ci = tl.load(cand + (th * 2 + 1) * c + pj, mask=kmask, other=0).to(tl.int64)
    tl.store(addr + th * m + k, ri * n + ci, mask=kmask)
    for a in tl.static_range(R):
        s = _side(scores, th, 0, a, pi, kmask, R, c)
        tl.store(sel + ((th * 2 + 0) * R + a) * m + k, s.to(sel.dtype.element_ty), mask=kmask)
        s = _side(scores, th, 1, a, pj, kmask, R, c)
        tl.store(sel + ((th * 2 + 1) * R + a) * m + k, s.to(sel.dtype.element_ty), mask=kmask)
