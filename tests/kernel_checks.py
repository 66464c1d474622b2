"""The lookup-reduce and row-optimizer kernels' shared checks: random cases, derived rounding bounds
and comparisons with the plain references, run by the tests for every backend."""

import torch

from rmt.ops.fused_update import FusedValueUpdate
from rmt.ops.lookup_reduce import lookup_reduce
from rmt.ops.reference import acc_dtype, reference_backward, reference_forward
from rmt.ops.sparse_optim import RowWiseAdagrad, rowwise_adagrad_update_, sparse_adam_update_

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
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


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


def check_backend(
    backend, case, dtype=torch.float32, sparse_grad=False, seed=0, device="cpu", tolerance=None, table_dtype=None
):
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
    got = [x.cpu() for x in run_op(lookup_reduce, *moved[:4], E, moved[4], backend=backend, sparse_grad=sparse_grad)]
    wide = acc_dtype(dtype)
    want = run_op(reference_forward, table.to(wide), indices, scores.to(wide), block_ids, E, grad_out.to(wide))
    for name, g, w, want_dtype in zip(("output", "table grad", "scores grad"), got, want, (dtype, table_dtype, dtype)):
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


def check_narrow_table(
    backend, case, table_dtype=torch.bfloat16, sparse_grad=False, seed=0, device="cpu", rounding="rne"
):
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
    table, indices, scores, block_ids, grad_out = make_case(
        N, D, T, K, C, E, torch.float32, seed, table_dtype=table_dtype
    )
    moved = [x if x is None else x.to(device) for x in (table, indices, scores, block_ids, grad_out)]
    got = [x.cpu() for x in run_op(lookup_reduce, *moved[:4], E, moved[4], backend=backend, sparse_grad=sparse_grad)]
    wide = [
        x.cpu()
        for x in run_op(
            lookup_reduce, moved[0].float(), *moved[1:4], E, moved[4], backend=backend, sparse_grad=sparse_grad
        )
    ]
    assert [g.dtype for g in got] == [torch.float32, table_dtype, torch.float32]
    for name, g, w in zip(("output", "table grad", "scores grad"), got, wide):
        assert torch.equal(g, round_fp32(w, g.dtype, rounding)), (
            f"{backend} {name} {case}: not the fp32 result rounded once"
        )

    f64 = lambda x: None if x is None else x.double()  # noqa: E731
    exact_out = reference_forward(f64(table), indices, f64(scores), block_ids, E)
    rows, exact_rows, exact_scores = reference_backward(f64(grad_out), f64(table), indices, f64(scores), block_ids, E)
    abs_out = reference_forward(f64(table).abs(), indices, f64(scores).abs(), block_ids, E)
    _, abs_rows, abs_scores = reference_backward(
        f64(grad_out).abs(), f64(table).abs(), indices, f64(scores).abs(), block_ids, E
    )
    u32, u64 = 2.0**-24, 2.0**-53
    finfo = torch.finfo(table_dtype)
    u_table, half_subnormal = finfo.eps / (2 if rounding == "rne" else 1), finfo.tiny * finfo.eps / 2
    counts = torch.bincount(indices.reshape(-1), minlength=N)[rows].double().unsqueeze(1)

    def gammas(n):
        return _gamma(n, u32) + _gamma(n, u64)

    exact_table = torch.zeros(N, D, dtype=torch.float64).index_copy_(0, rows, exact_rows)
    bound_table = torch.zeros(N, D, dtype=torch.float64).index_copy_(
        0, rows, u_table * exact_rows.abs() + (1 + u_table) * gammas(counts) * abs_rows + half_subnormal
    )
    for name, g, exact, bound in (
        ("output", got[0], exact_out, gammas(K) * abs_out),
        ("table grad", got[1], exact_table, bound_table),
        ("scores grad", got[2], exact_scores, gammas(D // C) * abs_scores),
    ):
        excess = (g.double() - exact).abs() - bound
        assert bool((excess <= 0).all()), f"{backend} {name} {case}: beyond the derived bound by {excess.max():.3g}"


def assert_rounded_within(got, x, bound, rounding="rne", what=""):
    """Each entry of ``got`` (the table's dtype) is the rounding of some value within ``bound`` of
    the fp32 ``x``: rounding is monotone, so ``rn(x - bound) <= got <= rn(x + bound)``. For an fp32
    ``got`` this is ``|got - x| <= bound`` (to an fp32 ulp of the ends)."""
    lo = round_fp32((x.double() - bound).float(), got.dtype, rounding)
    hi = round_fp32((x.double() + bound).float(), got.dtype, rounding)
    bad = ~((got >= lo) & (got <= hi))
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} entries are no rounding of a value within the bound, "
        f"e.g. {got[bad][:3].tolist()} for {x[bad][:3].tolist()}"
    )


# How far a fused row-wise optimizer kernel's fp32 row may lie from the torch reference's, as a
# multiple of the row's update |p_old - x_ref| (plus 2^-21 |x_ref| for the final subtraction's
# roundings). Adam: the moments are the same operations (bit-identical); only the square root
# may differ, by an ulp (torch's vectorized CPU sqrt is not correctly rounded), which moves the
# quotient, the step and the subtraction by a few rounding units: 2^-20 covers 2^-22 + 2^-23 +
# 2^-24 ... with room. Row-wise Adagrad also sums a row's D squares in another order: the
# accumulators differ by up to 2 gamma_{D+1} relative, the scale by half that.
ADAM_REL = 2.0**-20


def adagrad_rel(D):
    return _gamma(D + 1, 2.0**-24) + 2.0**-20


def check_row_optimizer_kernels(impl, table_dtype, device="cpu", rounding="rne", seed=0):
    """One step of ``impl``'s fused kernels (``sparse_adam_step``, ``rowwise_adagrad_step``: the
    C++ extension or :mod:`rmt.ops.triton_sparse_optim`) on a table of ``table_dtype`` with fp32
    state, from a non-zero state, against the torch references of :mod:`rmt.ops.sparse_optim`:

    (a) kernel vs reference: Adam's moments equal bit for bit; Adagrad's accumulators within
        2 gamma_{D+1}; the new rows within the rounding of an fp32 value no further from the
        reference's fp32 row than ADAM_REL / adagrad_rel(D) of its update;
    (b) the narrow table's step is the fp32 step on the same (representable) row, gradient and
        state, rounded once: for the kernel and for the reference, bit for bit, state included;
    (c) with weight_decay 0 the row-wise Adagrad kernel adds no decay term, as the reference: a
        touched row holding infinite weights keeps its finite gradient and sum (``check_zero_decay``).
    """

    gen = torch.Generator().manual_seed(seed)
    N, D = 50, 20
    table = torch.randn(N, D, generator=gen).to(table_dtype).to(device)
    rows = torch.tensor([0, 3, 17, 31, 49], device=device)
    values = torch.randn(rows.numel(), D, generator=gen).to(table_dtype).to(device)
    m0 = (0.1 * torch.randn(N, D, generator=gen)).to(device)
    v0 = (0.1 * torch.rand(N, D, generator=gen)).to(device)
    s0 = torch.rand(N, generator=gen).to(device)
    adam = (0.01, 0.8, 0.95, 1e-6, 3)
    adagrad = (0.1, 1e-10, 0.01)

    def run(update, *state):
        def go(t):
            param, copies = t.clone(), [x.clone() for x in state]
            update(param, *copies, rows, values.to(t.dtype), *(adam if len(state) == 2 else adagrad))
            return [param] + copies

        return go(table.float()), go(table)

    for name, ref_update, kernel_update, state, rel in (
        ("sparse_adam", sparse_adam_update_, impl.sparse_adam_step, (m0, v0), ADAM_REL),
        ("rowwise_adagrad", rowwise_adagrad_update_, impl.rowwise_adagrad_step, (s0,), adagrad_rel(D)),
    ):
        ref32, ref_narrow = run(ref_update, *state)
        ker32, ker_narrow = run(kernel_update, *state)
        x = ref32[0]
        assert torch.equal(ref_narrow[0], round_fp32(x, table_dtype)), f"{name} reference: not fp32 rounded once"
        assert torch.equal(ker_narrow[0], round_fp32(ker32[0], table_dtype, rounding)), (
            f"{name} kernel: not its fp32 step rounded once"
        )
        for got, want in zip(ref_narrow[1:] + ker_narrow[1:], ref32[1:] + ker32[1:]):
            assert got.dtype == torch.float32 and torch.equal(got, want), f"{name}: state differs from the fp32 step"
        if name == "sparse_adam":
            for got, want in zip(ker32[1:], ref32[1:]):
                assert torch.equal(got, want), f"{name} kernel moments differ from the reference"
        else:
            torch.testing.assert_close(ker32[1], ref32[1], rtol=2 * _gamma(D + 1, 2.0**-24), atol=0)
        bound = rel * (x - table.float()).abs() + 2.0**-21 * x.abs()
        assert_rounded_within(ker32[0], x, bound, "rne", f"{name} fp32 kernel vs reference")
        assert_rounded_within(ker_narrow[0], x, bound, rounding, f"{name} {table_dtype} kernel vs reference")
    check_zero_decay(
        lambda param, state, u_rows, u_values: impl.rowwise_adagrad_step(
            param, state, u_rows, u_values, *adagrad[:2], 0.0
        ),
        table.float(),
        rows,
        values.float(),
        s0,
        *adagrad[:2],
    )


def check_zero_decay(step, table, rows, values, state, lr, eps):
    """``step(param, state, rows, values)`` (one row-wise Adagrad step with weight_decay 0, in
    place) against :func:`rmt.ops.sparse_optim.rowwise_adagrad_update_` on a copy of the fp32
    ``table`` whose first two touched rows hold +inf and -inf weights. The reference adds no decay
    term at weight_decay 0, so those rows' gradients, and their sums, stay finite; a kernel
    computing g + 0 * p would make them NaN. Finite entries within the bounds of
    check_row_optimizer_kernels (a), the sums within 2 gamma_{D+1}; the infinite ones equal."""

    start = table.clone()
    start[rows[0], 0], start[rows[1], -1] = float("inf"), float("-inf")
    got, got_state = start.clone(), state.clone()
    want, want_state = start.clone(), state.clone()
    step(got, got_state, rows, values)
    rowwise_adagrad_update_(want, want_state, rows, values, lr, eps, 0.0)
    D = table.shape[1]
    assert bool(want_state.isfinite().all()), "reference: a sum is not finite"
    torch.testing.assert_close(got_state, want_state, rtol=2 * _gamma(D + 1, 2.0**-24), atol=0)
    finite = start.isfinite()
    assert torch.equal(got[~finite], start[~finite]) and torch.equal(want[~finite], start[~finite]), (
        "an infinite weight did not stay as it was"
    )
    x = want[finite]
    bound = adagrad_rel(D) * (x - start[finite]).abs() + 2.0**-21 * x.abs()
    assert_rounded_within(got[finite], x, bound, "rne", "row-wise Adagrad at weight_decay 0 vs reference")


def check_fused_zero_decay(backend, device="cpu", seed=0):
    """The row-wise Adagrad step fused into ``backend``'s backward (:class:`FusedValueUpdate`)
    with weight_decay 0, one step from non-zero sums, against the reference: ``check_zero_decay``,
    the step being the fused backward's update of the touched rows (their gradients taken by the
    reference backend for the reference step)."""

    gen = torch.Generator().manual_seed(seed)
    N, D, T, K = 40, 24, 6, 4
    table = torch.randn(N, D, generator=gen)
    # distinct rows: each touched row's gradient is one product, the same bits in every backend
    indices = torch.randperm(N, generator=gen)[: T * K].view(T, K)
    scores = torch.randn(T, K, 1, generator=gen)
    grad_out = torch.randn(T, 1, D, generator=gen)
    ref = table.clone().requires_grad_(True)
    lookup_reduce(ref, indices, scores, sparse_grad=True, backend="reference").backward(grad_out)
    grad = ref.grad.coalesce()
    rows, values = grad.indices()[0], grad.values()

    lr, eps = 0.1, 1e-10

    def step(param, state, u_rows, u_values):
        p = torch.nn.Parameter(param.to(device))
        opt = RowWiseAdagrad([p], lr=lr, eps=eps, weight_decay=0.0)
        opt.state[p]["sum"] = state.to(device)
        update = FusedValueUpdate(p, opt)
        lookup_reduce(p, indices.to(device), scores.to(device), backend=backend, update=update).backward(
            grad_out.to(device)
        )
        param.copy_(p.detach().cpu())
        state.copy_(opt.state[p]["sum"].cpu())

    check_zero_decay(step, table, rows, values, torch.rand(N, generator=gen), lr, eps)
