"""Random inputs and reference comparisons for lookup_reduce backends (used by the tests)."""

import torch

from .lookup_reduce import lookup_reduce
from .reference import acc_dtype, reference_backward, reference_forward

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

# The (table dtype, scores dtype) pairs of the op's contract on every backend but float64.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def make_case(N, D, T, K, C, E, dtype=torch.float32, seed=0, device="cpu", table_dtype=None):
    """Random table/indices/scores/block ids/output gradient; every token repeats its first index
    once. The table has ``table_dtype`` (default ``dtype``), scores and output gradient ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(N, D, generator=gen).to(table_dtype or dtype)
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


def check_backend(backend, case, dtype=torch.float32, sparse_grad=False, seed=0, device="cpu", tolerance=None,
                  table_dtype=None):
    """Assert that ``backend`` on ``device`` matches the plain-torch reference (autograd, on the
    CPU) on one case: scores of ``dtype``, a table of ``table_dtype`` (default ``dtype``).

    The reference runs on the same (possibly low-precision) inputs, upcast to fp32 (fp64 for
    fp64), so the comparison measures only the two summation orders' rounding and the final
    rounding of each result to its dtype (the table gradient to the table's, the rest to the
    scores'); ``tolerance`` (rtol/atol) replaces the scores dtype's default, for sums of thousands
    of terms.
    """
    N, D, T, K, C, E = case
    table_dtype = table_dtype or dtype
    table, indices, scores, block_ids, grad_out = make_case(N, D, T, K, C, E, dtype, seed, table_dtype=table_dtype)
    moved = [x if x is None else x.to(device) for x in (table, indices, scores, block_ids, grad_out)]
    got = [x.cpu() for x in run_op(lookup_reduce, *moved[:4], E, moved[4], backend=backend,
                                   sparse_grad=sparse_grad)]
    wide = acc_dtype(dtype)
    want = run_op(reference_forward, table.to(wide), indices, scores.to(wide), block_ids, E,
                  grad_out.to(wide))
    for name, g, w, want_dtype in zip(("output", "table grad", "scores grad"), got, want,
                                      (dtype, table_dtype, dtype)):
        assert g.dtype == want_dtype, f"{backend} {name} dtype {g.dtype} != {want_dtype}"
        tol = TOLERANCES[want_dtype] if want_dtype != dtype else (tolerance or TOLERANCES[dtype])
        torch.testing.assert_close(g.to(wide), w, **tol, msg=lambda m: f"{backend} {name} {case} {dtype}: {m}")


def round_fp32(x, dtype, rounding="rne"):
    """fp32 ``x`` rounded to ``dtype``: to nearest, ties to even (``rounding="rne"``: torch's
    ``.to``, the C++ and CUDA kernels, Triton on a GPU), or for bf16 toward zero (``"rtz"``: the
    Triton 3.x interpreter, whose fp32 -> bf16 conversion truncates the low 16 bits)."""
    if rounding == "rne" or dtype != torch.bfloat16:
        return x.to(dtype)
    return (x.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)


def _gamma(n, unit_roundoff):
    """gamma_n = n u / (1 - n u): the relative bound of an n-term fp dot product or sum, any order
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and Eq. 3.5)."""
    nu = n * unit_roundoff
    return nu / (1 - nu)


def check_narrow_table(backend, case, table_dtype=torch.bfloat16, sparse_grad=False, seed=0, device="cpu",
                       rounding="rne"):
    """A bf16/fp16 table with fp32 scores (the op's mixed-precision contract) on ``backend``:

    1. the same as the backend's fp32 computation on the table's values upcast, bit for bit: the
       output and the score gradients equal, the table gradient equals the fp32 one rounded once
       to the table dtype (both runs make the same fp32 operations in the same order on the same
       values; the narrow one only converts the table on load and its gradient on store);
    2. within the derived bound of the exact result (float64 from the same values): an n-term
       fp32 sum of products is within gamma_n(2^-24) * sum|terms| of it in any summation order,
       with n = K per output element, D/C per score gradient and the row's lookup count per
       table-gradient element; the table gradient's rounding adds u |exact| (u = 2^-8 for bf16,
       2^-11 for fp16; twice that for ``rounding="rtz"``, see :func:`round_fp32`) plus half the
       dtype's smallest subnormal spacing. The float64 reference itself is within
       gamma_n(2^-53) * sum|terms| (added).
    """
    N, D, T, K, C, E = case
    table, indices, scores, block_ids, grad_out = make_case(N, D, T, K, C, E, torch.float32, seed,
                                                            table_dtype=table_dtype)
    moved = [x if x is None else x.to(device) for x in (table, indices, scores, block_ids, grad_out)]
    got = [x.cpu() for x in run_op(lookup_reduce, *moved[:4], E, moved[4], backend=backend, sparse_grad=sparse_grad)]
    wide = [x.cpu() for x in run_op(lookup_reduce, moved[0].float(), *moved[1:4], E, moved[4], backend=backend,
                                    sparse_grad=sparse_grad)]
    assert [g.dtype for g in got] == [torch.float32, table_dtype, torch.float32]
    for name, g, w in zip(("output", "table grad", "scores grad"), got, wide):
        assert torch.equal(g, round_fp32(w, g.dtype, rounding)), f"{backend} {name} {case}: not the fp32 result rounded once"

    f64 = lambda x: None if x is None else x.double()  # noqa: E731
    exact_out = reference_forward(f64(table), indices, f64(scores), block_ids, E)
    rows, exact_rows, exact_scores = reference_backward(f64(grad_out), f64(table), indices, f64(scores), block_ids, E)
    abs_out = reference_forward(f64(table).abs(), indices, f64(scores).abs(), block_ids, E)
    _, abs_rows, abs_scores = reference_backward(f64(grad_out).abs(), f64(table).abs(), indices, f64(scores).abs(),
                                                 block_ids, E)
    u32, u64 = 2.0 ** -24, 2.0 ** -53
    finfo = torch.finfo(table_dtype)
    u_table, half_subnormal = finfo.eps / (2 if rounding == "rne" else 1), finfo.tiny * finfo.eps / 2
    counts = torch.bincount(indices.reshape(-1), minlength=N)[rows].double().unsqueeze(1)

    def gammas(n):
        return _gamma(n, u32) + _gamma(n, u64)

    exact_table = torch.zeros(N, D, dtype=torch.float64).index_copy_(0, rows, exact_rows)
    bound_table = torch.zeros(N, D, dtype=torch.float64).index_copy_(
        0, rows, u_table * exact_rows.abs() + (1 + u_table) * gammas(counts) * abs_rows + half_subnormal)
    for name, g, exact, bound in (("output", got[0], exact_out, gammas(K) * abs_out),
                                  ("table grad", got[1], exact_table, bound_table),
                                  ("scores grad", got[2], exact_scores, gammas(D // C) * abs_scores)):
        excess = (g.double() - exact).abs() - bound
        assert bool((excess <= 0).all()), f"{backend} {name} {case}: beyond the derived bound by {excess.max():.3g}"
