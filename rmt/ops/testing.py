"""Random inputs and reference comparisons for lookup_reduce backends (used by the tests)."""

import torch

from .lookup_reduce import lookup_reduce
from .reference import reference_forward

# (N, D, T, K, C, E): D not a power of two, C=2, E=4, T=0, K=1, a tiny table forcing duplicates.
CASES = [
    (64, 16, 6, 8, 1, 1),
    (50, 12, 5, 7, 2, 4),
    (7, 100, 9, 16, 4, 3),
    (1000, 48, 4, 32, 2, 1),
    (30, 8, 0, 5, 1, 2),
    (20, 6, 3, 1, 3, 4),
]

TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=5e-6),
    torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
    torch.float16: dict(rtol=2e-3, atol=5e-3),
}


def make_case(N, D, T, K, C, E, dtype=torch.float32, seed=0, device="cpu"):
    """Random table/indices/scores/block ids; every token repeats its first index once."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(N, D, generator=gen).to(dtype)
    indices = torch.randint(0, N, (T, K), generator=gen)
    if K > 1:
        indices[:, 1] = indices[:, 0]
    scores = torch.randn(T, K, C, generator=gen).to(dtype)
    block_ids = torch.randint(0, E, (T, K), generator=gen) if E > 1 else None
    grad_out = torch.randn(T, E, D, generator=gen).to(dtype)
    return [x if x is None else x.to(device) for x in (table, indices, scores, block_ids, grad_out)]


def run_op(fn, table, indices, scores, block_ids, num_blocks, grad_out, **kwargs):
    """Forward, then gradients w.r.t. table (dense) and scores for the given output gradient."""
    table = table.detach().requires_grad_(True)
    scores = scores.detach().requires_grad_(True)
    out = fn(table, indices, scores, block_ids, num_blocks, **kwargs)
    g_table, g_scores = torch.autograd.grad(out, [table, scores], grad_out)
    if g_table.is_sparse:
        g_table = g_table.to_dense()
    return out.detach(), g_table, g_scores


def check_backend(backend, case, dtype=torch.float32, sparse_grad=False, seed=0, device="cpu", tolerance=None):
    """Assert that ``backend`` on ``device`` matches the plain-torch reference (autograd, on the
    CPU) on one case.

    The reference runs on the same (possibly low-precision) inputs, upcast to fp32 (fp64 for
    fp64), so the comparison measures only the two summation orders' rounding; ``tolerance``
    (rtol/atol) replaces the dtype's default, for sums of thousands of terms.
    """
    N, D, T, K, C, E = case
    table, indices, scores, block_ids, grad_out = make_case(N, D, T, K, C, E, dtype, seed)
    moved = [x if x is None else x.to(device) for x in (table, indices, scores, block_ids, grad_out)]
    got = [x.cpu() for x in run_op(lookup_reduce, *moved[:4], E, moved[4], backend=backend,
                                   sparse_grad=sparse_grad)]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = run_op(reference_forward, table.to(wide), indices, scores.to(wide), block_ids, E,
                  grad_out.to(wide))
    for name, g, w in zip(("output", "table grad", "scores grad"), got, want):
        assert g.dtype == dtype, f"{backend} {name} dtype {g.dtype} != {dtype}"
        torch.testing.assert_close(g.to(wide), w, **(tolerance or TOLERANCES[dtype]),
                                   msg=lambda m: f"{backend} {name} {case} {dtype}: {m}")
