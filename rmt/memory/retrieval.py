"""Key retrieval of memory layers: product keys (PKM, UltraMem Eq. 2-3) and Tucker-decomposed
query-key retrieval with multi-core scoring (TDQKR + MCS, Eq. 4-12 and 16-17).

The selections here take per-side scores of shape ``[T, H, r, n]`` (T tokens, H heads, Tucker
rank r (1 for product keys), n keys per side) and return grid addresses ``row * n + col`` of shape
``[T, H, m]`` with their scores ``[T, H, m, C]`` (C = number of cores, 1 for product keys): the
unfused path, the reference of the fused op (:mod:`rmt.ops.fused_retrieval`), which selects the
same addresses under the same tie rule (:mod:`rmt.ops.topm`) without the score tensors.
"""

from __future__ import annotations

import functools
import math
from typing import Tuple

import torch

from rmt.ops.topm import grid_topm, selected_scores, side_candidates


def product_topk(s_row: torch.Tensor, s_col: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two-phase top-m of ``s_row[i] + s_col[j]`` (Eq. 2-3); exact, under the tie rule of
    :mod:`rmt.ops.topm`. Inputs ``[T, H, 1, n]``; returns addresses ``[T, H, m]`` (best first)
    and their scores ``[T, H, m, 1]``, differentiable in both sides."""
    n = s_row.shape[-1]
    rows, cols = side_candidates(s_row.detach(), None, m), side_candidates(s_col.detach(), None, m)
    addr, _ = grid_topm(rows, _at(s_row.detach(), rows), cols, _at(s_col.detach(), cols), m, n)
    return addr, selected_scores(_selected(s_row, s_col, addr), None)


def _at(s: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Side scores ``[T, H, r, c]`` of ``s [T, H, r, n]`` at key indices ``idx [T, H, c]``."""
    return s.gather(-1, idx.unsqueeze(2).expand(-1, -1, s.shape[2], -1))


def _selected(s_row: torch.Tensor, s_col: torch.Tensor, addr: torch.Tensor) -> torch.Tensor:
    """The side scores at grid addresses ``addr [T, H, m]``: ``[T, H, 2, r, m]`` (row side first),
    differentiable."""
    n = s_row.shape[-1]
    return torch.stack([_at(s_row, addr // n), _at(s_col, addr % n)], 2)


def leading_singular_vectors(core: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``u, t`` of the rank-1 SVD approximation ``C ~ lambda_1 u t^T`` (Eq. 6-7) of ``[H, r, r]``
    cores; no gradient (they only select candidates). Rank 2 (UltraMem's) in closed form: ``u``
    the leading eigenvector of the symmetric ``C C^T``, at half the angle ``atan2(2 g_01, g_00 -
    g_11)``, and ``t = C^T u / |C^T u|``. Element-wise tensor ops with no host wait on a GPU, where
    ``torch.linalg.svd`` checks its solver's status on the host (a wait that drains the device's
    queue in the middle of the forward). Equal to the SVD's vectors up to their sign, which the
    selection does not depend on (:func:`tucker_select`), and to rounding."""
    with torch.no_grad():
        c = core.float()
        if c.shape[-1] == 2:
            g = c @ c.transpose(-1, -2)
            angle = 0.5 * torch.atan2(2 * g[..., 0, 1], g[..., 0, 0] - g[..., 1, 1])
            u = torch.stack([angle.cos(), angle.sin()], -1)
            t = (c.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1)
            t = t / t.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny)
        else:
            U, _, Vh = torch.linalg.svd(c)
            u, t = U[..., :, 0], Vh[..., 0, :]
    return u.to(core.dtype), t.to(core.dtype)


@functools.cache
def _rank2_maps(dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The constant maps of :func:`singular_values`, made once per dtype and device (a tensor
    made from host numbers is copied to a GPU, a wait): (a, b, c, d) -> (a + d, c - b, a - d,
    b + c) / 2, and (q, p) -> (q + p, q - p)."""
    half = torch.tensor(
        ((0.5, 0.0, 0.0, 0.5), (0.0, -0.5, 0.5, 0.0), (0.5, 0.0, 0.0, -0.5), (0.0, 0.5, 0.5, 0.0)),
        dtype=dtype,
        device=device,
    )
    return half, torch.tensor(((1.0, 1.0), (1.0, -1.0)), dtype=dtype, device=device)


def singular_values(c: torch.Tensor) -> torch.Tensor:
    """Singular values ``[..., r]`` of ``[..., r, r]`` matrices, descending, differentiable, as
    ``torch.linalg.svdvals``; for ``r = 2`` in closed form (no host wait on a GPU, see
    :func:`leading_singular_vectors`): with ``q = |(a + d, c - b)| / 2`` and ``p = |(a - d, b +
    c)| / 2`` of ``[[a, b], [c, d]]``, the values are ``q + p`` and ``|q - p|``, in a few
    batched operations (a matrix product for the four half sums). The squared norms are clamped
    at the smallest normal number of fp32 (fp64 for fp64 input, which alone is computed in its own
    dtype), so the gradient is finite where one of them vanishes (a value grows by at most twice
    that number's square root, 2e-19 in fp32)."""
    if c.shape[-1] != 2:
        return torch.linalg.svdvals(c)
    work = c if c.dtype == torch.float64 else c.float()  # fp16's smallest normal would show
    half, both = _rank2_maps(work.dtype, work.device)
    pairs = (work.flatten(-2) @ half.T).unflatten(-1, (2, 2))  # [..., (q, p), 2]
    qp = pairs.square().sum(-1).clamp_min(torch.finfo(work.dtype).tiny).sqrt()
    return (qp @ both.T).abs().to(c.dtype)


def rank1_selector(cores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the TDQKR selection needs from ``[H, h, r, r]`` cores: the aggregated core
    ``C = sum_i C^(i)`` and its leading singular vectors ``u, t`` (Eq. 6-7), without gradient.
    Depends on the weights only, so decoding computes it once (``MemoryLayer``)."""
    with torch.no_grad():
        total = cores.sum(1)
    return (total,) + leading_singular_vectors(total)


def tucker_select(s_row: torch.Tensor, s_col: torch.Tensor, selector, m: int) -> torch.Tensor:
    """Grid addresses ``[T, H, m]`` of the TDQKR two-phase top-m (Eq. 7-10), best first, under
    the tie rule of :mod:`rmt.ops.topm`.

    ``selector`` is :func:`rank1_selector`'s ``(C, u, t)``. Phase 1 keeps, per side, the
    candidates of the rank-1 objective ``u^T S_row`` / ``t^T S_col`` (Eq. 8-9). Singular vectors
    have no canonical sign and side scores take both signs, so the m largest *and* the m smallest
    entries are kept: then the selection is exact whenever C has rank 1 and the m-th best grid
    score is positive. Phase 2 takes the exact top-m of ``S_row^T C S_col`` over the candidate
    grid (Eq. 10). The fused op (:mod:`rmt.ops.fused_retrieval`) selects the same addresses
    without the ``[T, H, r, n]`` scores."""
    total, u, t = selector
    s_row, s_col = s_row.detach(), s_col.detach()
    rows, cols = side_candidates(s_row, u, m), side_candidates(s_col, t, m)
    return grid_topm(rows, _at(s_row, rows), cols, _at(s_col, cols), m, s_row.shape[-1], total)[0]


def tucker_topk(s_row: torch.Tensor, s_col: torch.Tensor, cores: torch.Tensor, m: int, selector=None):
    """TDQKR two-phase top-m (Eq. 7-10) with multi-core scoring (Eq. 16).

    ``cores`` is ``[H, h, r, r]``; the selection (:func:`tucker_select`) uses the aggregated core
    ``C = sum_i C^(i)`` (``selector``: its precomputed :func:`rank1_selector`, or None). Returns
    grid addresses ``[T, H, m]`` and each core's score ``S_row^T C^(i) S_col`` (Eq. 16) at them
    as the C columns ``[T, H, m, h]``, differentiable in ``s_row``, ``s_col`` and ``cores``.
    """
    addr = tucker_select(s_row, s_col, selector or rank1_selector(cores), m)
    return addr, selected_scores(_selected(s_row, s_col, addr), cores)


def tucker_aux_loss(cores: torch.Tensor, weight: float, margin: float) -> torch.Tensor:
    """Eq. 11-12: ``alpha / (r-1) * sum_{i>=2} max(0, lambda_i - tau)^2`` of the aggregated core
    ``C = sum_i C^(i)``, averaged over heads (``cores``: ``[H, h, r, r]``)."""
    r = cores.shape[-1]
    if r < 2 or weight == 0:
        return cores.new_zeros(())
    lam = singular_values(cores.sum(1))
    return weight / (r - 1) * torch.relu(lam[:, 1:] - margin).pow(2).sum(-1).mean()


def expected_topm_mean(num_candidates: int, m: int, samples: int = 0, seed: int = 0) -> float:
    """E[Y], Y = mean of the top-m of ``num_candidates`` = K standard normals (UltraMem Appendix A).

    ``samples = 0``: exactly, by quadrature. The densities of the m largest order statistics sum
    to ``K phi(x) P[B <= m - 1]`` with ``B ~ Binomial(K - 1, 1 - Phi(x))`` (the other candidates
    above x), so ``E[Y] = K / m * integral x phi(x) P[B <= m - 1] dx``; the binomial CDF is summed
    in log space and the integral taken by the trapezoid rule on ``[-12, 12]`` (step 5e-4), in time and memory independent of K. ``samples > 0``: the paper's Monte Carlo
    estimate from that many draws of K normals, streamed in chunks of at most ``2^20`` candidates
    (a running top-m per draw), so memory stays bounded however many slots the table has."""
    m = min(m, num_candidates)
    if samples:
        return _sampled_topm_mean(num_candidates, m, samples, seed)
    x = torch.linspace(-12.0, 12.0, 48001, dtype=torch.float64)
    n = torch.tensor(float(num_candidates - 1), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for part in x.split(4096):
        j = torch.arange(m, dtype=torch.float64)
        log_q, log_p = torch.special.log_ndtr(-part)[:, None], torch.special.log_ndtr(part)[:, None]
        log_binom = torch.lgamma(n + 1) - torch.lgamma(j + 1) - torch.lgamma(n - j + 1)
        log_cdf = torch.logsumexp(log_binom + j * log_q + (n - j) * log_p, dim=1)
        log_phi = -0.5 * part * part - 0.5 * math.log(2 * math.pi)
        density = torch.exp(log_phi + log_cdf + math.log(num_candidates / m))
        total = total + (part * density).sum()
    return float(total) * float(x[1] - x[0])  # trapezoid rule: the end points' integrand is ~exp(-72)


def _sampled_topm_mean(num_candidates: int, m: int, samples: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    best = torch.full((samples, m), -math.inf)
    for start in range(0, num_candidates, 1 << 20):
        chunk = torch.randn(samples, min(1 << 20, num_candidates - start), generator=gen)
        best = torch.cat([best, chunk], dim=1).topk(m, dim=-1).values
    return float(best.mean(-1).mean())


def grid_side(num_keys: int, ive_blocks: int) -> int:
    """Keys per side of the virtual grid: ``num_keys * sqrt(E)`` (IVE grows the keys by sqrt(E))."""
    return num_keys * math.isqrt(ive_blocks)
