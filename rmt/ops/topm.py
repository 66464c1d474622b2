"""Exact top-m selection of the memory layers' key retrieval under one tie rule: the pieces the
fused retrieval op's backends (:mod:`rmt.ops.fused_retrieval`) and the unfused path
(:mod:`rmt.memory.retrieval`) share, so the two select the same addresses (UltraMem Eq. 2-3,
7-10).

Tie rule. Every selection orders its entries by score descending, and among equal scores by
index ascending: the lower key index (on a grid side) or the lower grid address
(``row * n + col``) comes first. The top m are the first m entries of that order; TDQKR's m
smallest rank-1 objectives (Eq. 8-9) are its *last* m, so among equal objectives the higher key
index is the smaller one, and the two candidate lists of a side never share a key.

Arithmetic. Side scores are taken as given (the product ``q . k`` rounded to the inputs' dtype);
everything computed from them (TDQKR's rank-1 objectives, the product-key sums, the candidate
grid ``S_row^T C S_col``) is computed in the accumulation dtype (float64 for float64 inputs, else
float32), one rounded operation after another in the order the functions state (no fused
multiply-add), so that a kernel doing the same operations in the same order selects the same
addresses bit for bit. NaN scores are not supported.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import acc_dtype


def ordered_topm(x: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Values and positions ``[..., m]`` of the m largest entries of ``x`` along its last dim, in
    the order (value descending, position ascending): among equal values the lower position is
    taken and comes first (the tie rule). ``torch.topk`` breaks ties in no stated order, so its
    m-th value only fixes the set's bound: every entry above it is in, and of the entries equal to
    it the lowest positions fill the rest (one more top-m, over int32 keys)."""
    n = x.shape[-1]
    kth = x.topk(m, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    pos = torch.arange(n, device=x.device, dtype=torch.int32 if 2 * n < 2**31 else torch.int64)
    key = torch.where(x > kth, pos, torch.where(x == kth, pos + n, 2 * n))
    first = key.topk(m, dim=-1, largest=False, sorted=True).indices  # above the bound, then tied
    values = x.gather(-1, first)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, first.gather(-1, order)


def rank1_objective(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """TDQKR's rank-1 objective ``w^T S`` (Eq. 8-9) of side scores ``s [T, H, r, n]`` and weights
    ``w [H, r]`` (``u`` for rows, ``t`` for columns): ``[T, H, n]`` in the accumulation dtype,
    summed over the rank in order, ``w_0 s_0 + w_1 s_1 + ...``."""
    acc = acc_dtype(s.dtype)
    w = w.to(acc)
    o = w[:, 0, None] * s[:, :, 0].to(acc)
    for a in range(1, s.shape[2]):
        o = o + w[:, a, None] * s[:, :, a].to(acc)
    return o


def side_candidates(s: torch.Tensor, w: Optional[torch.Tensor], m: int) -> torch.Tensor:
    """Key indices ``[T, H, c]`` of one side's candidates, from its scores ``s [T, H, r, n]``.
    Product keys (``w`` None, r = 1): the top m scores. TDQKR: the m largest then the m smallest
    rank-1 objectives (:func:`rank1_objective` with ``w``), or all n keys in index order when
    ``2m >= n``."""
    T, H, r, n = s.shape
    if w is None:
        return ordered_topm(s[:, :, 0], m)[1]
    if 2 * m >= n:
        return torch.arange(n, device=s.device).expand(T, H, n)
    o = rank1_objective(s, w)
    top = ordered_topm(o, m)[1]
    bottom = n - 1 - ordered_topm(-o.flip(-1), m)[1]  # the last m of the order: ties to the higher index
    return torch.cat([top, bottom], -1)


def _by_index(idx: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``idx [T, H, c]`` and their scores ``s [T, H, r, c]`` sorted by key index."""
    idx, order = idx.sort(-1)
    return idx, s.gather(-1, order.unsqueeze(2).expand(-1, -1, s.shape[2], -1))


def grid_topm(
    row_idx: torch.Tensor,
    row_s: torch.Tensor,
    col_idx: torch.Tensor,
    col_s: torch.Tensor,
    m: int,
    n: int,
    core: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact top-m of the grid over the candidates of both sides (Eq. 3, Eq. 10): grid
    addresses ``[T, H, m]`` (``row * n + col``, best first, ties to the lower address) and the
    side scores at them, ``[T, H, 2, r, m]`` (row side first), in the candidate scores' dtype.

    ``row_idx [T, H, R]`` / ``col_idx [T, H, K]`` are key indices without repeats, ``row_s [T, H,
    r, R]`` / ``col_s [T, H, r, K]`` their side scores. The grid score of a pair (i, j) is, in the
    accumulation dtype: product keys (``core`` None), ``s_row_i + s_col_j``; TDQKR, with the
    aggregated core ``C = core [H, r, r]``, ``sum_b (sum_a s_row_i[a] C[a, b]) s_col_j[b]``, each
    sum in order of its index. The candidates are sorted by key index first, so that the grid's
    row-major positions are in address order and :func:`ordered_topm` applies the tie rule."""
    T, H, r, _ = row_s.shape
    row_idx, row_s = _by_index(row_idx, row_s)
    col_idx, col_s = _by_index(col_idx, col_s)
    acc = acc_dtype(row_s.dtype)
    sr, sc = row_s.to(acc), col_s.to(acc)
    if core is None:
        grid = sr[:, :, 0, :, None] + sc[:, :, 0, None, :]
    else:
        c = core.to(acc)
        grid = None
        for b in range(r):
            rv = c[:, 0, b, None] * sr[:, :, 0]
            for a in range(1, r):
                rv = rv + c[:, a, b, None] * sr[:, :, a]
            term = rv[..., :, None] * sc[:, :, b, None, :]
            grid = term if grid is None else grid + term
    K = col_idx.shape[-1]
    pos = ordered_topm(grid.flatten(-2), m)[1]
    i, j = pos // K, pos % K
    addr = row_idx.gather(-1, i) * n + col_idx.gather(-1, j)
    sel = torch.stack(
        [
            row_s.gather(-1, i.unsqueeze(2).expand(-1, -1, r, -1)),
            col_s.gather(-1, j.unsqueeze(2).expand(-1, -1, r, -1)),
        ],
        2,
    )
    return addr, sel


class _MultiCoreScores(torch.autograd.Function):
    """Eq. 16 at the selected pairs, keeping only its operands for the backward (the side scores
    ``sel`` and the cores), where autograd's einsum would also keep its permuted copies."""

    @staticmethod
    def forward(ctx, sel, cores):
        ctx.save_for_backward(sel, cores)
        acc = acc_dtype(sel.dtype)
        with torch.autocast(sel.device.type, enabled=False):  # in the accumulation dtype under autocast too
            return torch.einsum("thak,hcab,thbk->thkc", sel[:, :, 0].to(acc), cores.to(acc), sel[:, :, 1].to(acc))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        sel, cores = ctx.saved_tensors
        acc = acc_dtype(sel.dtype)
        sr, sc, c, g = sel[:, :, 0].to(acc), sel[:, :, 1].to(acc), cores.to(acc), grad.to(acc)
        grad_sel = torch.stack(
            [torch.einsum("thkc,hcab,thbk->thak", g, c, sc), torch.einsum("thkc,hcab,thak->thbk", g, c, sr)], 2
        )
        return grad_sel.to(sel.dtype), torch.einsum("thkc,thak,thbk->hcab", g, sr, sc).to(cores.dtype)


def selected_scores(sel: torch.Tensor, cores: Optional[torch.Tensor]) -> torch.Tensor:
    """Scores ``[T, H, m, C]`` at the selected pairs from their side scores ``sel [T, H, 2, r, m]``,
    differentiable, computed in the accumulation dtype and rounded to ``sel``'s: product keys
    (``cores`` None), ``s_row + s_col`` (Eq. 3, C = 1); TDQKR, each core's ``S_row^T C^(i) S_col``
    (Eq. 16, ``cores [H, C, r, r]``). The backward keeps ``sel`` and the cores, nothing else."""
    if cores is None:
        acc = acc_dtype(sel.dtype)
        return (sel[:, :, 0, 0].to(acc) + sel[:, :, 1, 0].to(acc)).unsqueeze(-1).to(sel.dtype)
    return _MultiCoreScores.apply(sel, cores).to(sel.dtype)
