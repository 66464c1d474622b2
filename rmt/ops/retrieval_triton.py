"""Triton backend of the fused retrieval op (:mod:`rmt.ops.fused_retrieval`): three kernels of
:mod:`rmt.ops.retrieval_triton_kernels`.

1. candidates, one program per (block of tokens, head) and grid side: the side's keys streamed in
   tiles, scored with ``tl.dot`` (float32 in IEEE precision, not TF32), the running lists kept as
   ordered int64 keys (score and tie-break in one integer, so that the tie rule is the integers'
   order), each token's candidate indices written ascending, ``[T, H, 2, c]`` int32 (``c`` = m,
   2m, or all n keys while ``2m >= n`` for TDQKR, which needs no stream);
2. the candidates' side scores ``[T, H, 2, r, c]`` float32, one dot product each;
3. the grid top-m per (token, head), the grid streamed in tiles through the same running list.

The side scores that choose the candidates (step 1, a matrix product) and those the grid and the
outputs use (step 2, one dot product each) are each a float32 sum rounded once to the inputs'
dtype, in two summation orders: the contract's rounding (``rmt.ops.fused_retrieval``, step 1).
Every other operation is the CPU backend's, in its order, compiled without fused multiply-adds.
Working memory beside the outputs: the candidates and their scores, ``T H 2 c (4 + 4 r)`` bytes;
the tiles live in registers.

Runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests), which must be
set before Triton is first imported. Inputs: float32 or bfloat16.
"""

import torch

from .triton_backend import is_available  # noqa: F401  (CUDA tensors; CPU ones in the interpreter)

KEY_TILE = 128
"""Keys per tile of the candidates' stream (at least the list width)."""
TOKEN_BLOCK = 32
"""Tokens per program of the candidates' stream."""
GRID_TILE = 1024
"""Grid entries per tile of the grid top-m (at least its list width)."""


def _pow2(x, least=1):
    return max(least, 1 << (max(int(x), 1) - 1).bit_length())


def select(q_row, q_col, keys, m, selector=None, key_tile=None, token_block=None):
    """The contract of :func:`rmt.ops.retrieval_reference.select` (module docstring for how).
    ``key_tile`` and ``token_block`` are rounded up to powers of two of at least 16 (``tl.dot``'s
    least), the key tile to at least the list width."""
    from . import retrieval_triton_kernels as kernels

    T, H, r, D = q_row.shape
    n = keys.shape[3]
    device = keys.device
    tucker = selector is not None
    keys = keys.contiguous()
    c = n if tucker and 2 * m >= n else (2 * m if tucker else m)
    addr = torch.empty(T, H, m, dtype=torch.int64, device=device)
    sel = torch.empty(T, H, 2, r, m, dtype=keys.dtype, device=device)
    if T == 0:
        return addr, sel
    fp32 = keys.dtype == torch.float32
    BD = _pow2(D, 16)
    options = dict(enable_fp_fusion=False)
    if c == n and tucker:  # every key a candidate: nothing to stream
        cand = torch.arange(n, dtype=torch.int32, device=device).expand(T, H, 2, n).contiguous()
    else:
        cand = torch.empty(T, H, 2, c, dtype=torch.int32, device=device)
        M = _pow2(m)
        BT = _pow2(token_block or TOKEN_BLOCK, 16)
        BN = max(_pow2(key_tile or KEY_TILE, 16), M)
        weights = (None, None) if not tucker else (selector[1].float().contiguous(), selector[2].float().contiguous())
        for side, q in enumerate((q_row, q_col)):
            kernels.candidates_kernel[(_cdiv(T, BT), H)](
                q,
                keys,
                weights[side] if tucker else keys,
                cand,
                T,
                H,
                n,
                D,
                m,
                c,
                side,
                q.stride(0),
                q.stride(1),
                q.stride(2),
                R=r,
                TUCKER=tucker,
                FP32=fp32,
                WIDEN=device.type == "cpu",
                BT=BT,
                BN=BN,
                BD=BD,
                M=M,
                **options,
            )
    scores = torch.empty(T, H, 2, r, c, dtype=torch.float32, device=device)
    BC = min(_pow2(c), max(1, 4096 // BD))
    kernels.candidate_scores_kernel[(T * H * 2 * r, _cdiv(c, BC))](
        q_row,
        q_col,
        keys,
        cand,
        scores,
        H,
        n,
        D,
        c,
        *q_row.stride()[:3],
        *q_col.stride()[:3],
        R=r,
        FP32=fp32,
        BC=BC,
        BD=BD,
        **options,
    )
    MP = _pow2(m)
    C = _pow2(c)
    BJ = min(C, 128)
    BI = min(C, max(1, max(GRID_TILE, MP) // BJ))
    core = selector[0].float().contiguous() if tucker else scores
    kernels.grid_topm_kernel[(T * H,)](
        cand, scores, core, addr, sel, H, n, m, c, R=r, TUCKER=tucker, BI=BI, BJ=BJ, MP=MP, **options
    )
    return addr, sel


def _cdiv(a, b):
    return (a + b - 1) // b
