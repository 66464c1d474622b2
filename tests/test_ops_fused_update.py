"""The optimizer step fused into lookup_reduce's backward (rmt.ops.fused_update) against the
unfused path it replaces: the sparse touched-row gradient, then SparseAdam / RowWiseAdagrad."""

import pytest
import torch

from rmt.ops import cpu_backend, lookup_reduce
from rmt.ops.fused_update import FusedValueUpdate
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam

from kernel_checks import ADAM_REL, adagrad_rel, assert_rounded_within, check_fused_zero_decay, round_fp32

OPTIMIZERS = {
    "sparse_adam": lambda p: SparseAdam([p], lr=2e-2, betas=(0.8, 0.95), eps=1e-6),
    "rowwise_adagrad": lambda p: RowWiseAdagrad([p], lr=0.1, eps=1e-10, weight_decay=0.01),
}
# (N, D, T, K, C, E): compile-time row shapes (64 x 1, 64 x 2) and run-time ones (12 x 3)
SHAPES = [(300, 12, 10, 6, 3, 1), (500, 64, 16, 8, 2, 4), (400, 64, 20, 7, 1, 1)]


def batches(shape, steps, seed=0, dtype=torch.float32, score_dtype=None):
    N, D, T, K, C, E = shape
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        indices = torch.randint(0, N, (T, K), generator=gen)
        indices[:, 1] = indices[:, 0]  # duplicates within a token
        scores = torch.randn(T, K, C, generator=gen).to(score_dtype or dtype)
        blocks = torch.randint(0, E, (T, K), generator=gen) if E > 1 else None
        grad_out = torch.randn(T, E, D, generator=gen).to(score_dtype or dtype)
        out.append((indices, scores, blocks, grad_out))
    return out


def make_table(shape, dtype=torch.float32, seed=1):
    N, D = shape[:2]
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run(table, kind, steps, E, fused, backend="cpu", micro=1, device="cpu"):
    """Train ``table`` over ``steps`` (lists of ``micro`` batches) on ``device``; returns the
    parameter, the optimizer, the score gradients of every batch and the fused update (or None)."""
    p = torch.nn.Parameter(table.to(device, copy=True))
    opt = OPTIMIZERS[kind](p)
    update = FusedValueUpdate(p, opt) if fused else None
    score_grads = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        for i, batch in enumerate(step):
            indices, scores, blocks, grad_out = (None if t is None else t.to(device) for t in batch)
            if update is not None:
                update.final = i == len(step) - 1
            s = scores.clone().requires_grad_(True)
            out = lookup_reduce(p, indices, s, blocks, E, backend=backend, sparse_grad=True, update=update)
            out.backward(grad_out)
            score_grads.append(s.grad)
        if fused:
            assert p.grad is None
        else:
            opt.step()
    return p, opt, score_grads, update


def state_tensors(opt, p):
    st = opt.state[p]
    return [st[k] for k in ("exp_avg", "exp_avg_sq", "sum") if k in st]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_equals_unfused_bit_for_bit(kind, shape, dtype):
    """One micro-batch per step: the fused kernel sums each row's gradient as the backward does and
    steps it with the optimizer's own row rule (csrc/row_optim.h), so table, state and score
    gradients equal the unfused path's exactly."""
    steps = [[b] for b in batches(shape, 3, dtype=dtype)]
    table = make_table(shape, dtype)
    p_u, opt_u, sg_u, _ = run(table, kind, steps, shape[5], fused=False)
    p_f, opt_f, sg_f, update = run(table, kind, steps, shape[5], fused=True)
    assert update.updates == 3 and not update.stash and update.pending == 0
    assert torch.equal(p_f.data, p_u.data)
    assert not torch.equal(p_f.data, table)
    for a, b in zip(state_tensors(opt_f, p_f), state_tensors(opt_u, p_u)):
        assert torch.equal(a, b)
    if kind == "sparse_adam":
        assert opt_f.state[p_f]["step"] == opt_u.state[p_u]["step"] == 3
    for a, b in zip(sg_f, sg_u):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_large_batch_fused_step_is_thread_count_independent(kind):
    """65536 lookups into 2^17 rows, rows that occur once and runs of several in bulk, sorted in
    per-thread slices: 1, 2 and 3 threads give the same table, state, score gradients and squared
    norm (its partial sums are chunked independently of the thread count), and equal the
    unfused step."""
    shape = (1 << 17, 16, 2048, 32, 1, 1)
    steps = [[b] for b in batches(shape, 1)]
    table = make_table(shape)
    p_u, opt_u, sg_u, _ = run(table, kind, steps, 1, fused=False)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            p_f, opt_f, sg_f, update = run(table, kind, steps, 1, fused=True)
            results.append((p_f.data, state_tensors(opt_f, p_f), sg_f, update.pop_sq_norm()))
    finally:
        torch.set_num_threads(threads)
    singles = (torch.bincount(steps[0][0][0].flatten(), minlength=shape[0]) == 1).sum()
    assert singles > 30000 and 65536 - singles > 20000  # both kinds of row, in bulk
    for p_f, state, sg_f, sq in results:
        assert torch.equal(p_f, p_u.data)
        assert all(torch.equal(a, b) for a, b in zip(state, state_tensors(opt_u, p_u)))
        assert all(torch.equal(a, b) for a, b in zip(sg_f, sg_u))
        assert sq == results[0][3]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_fused_step_with_grad_scale_is_thread_count_independent(kind):
    """With a grad scale, 1 and 3 threads give the same table, state, score gradients and squared
    norm, bit for bit. 65536 lookups of 2^17 rows, ~40k single and ~26k repeated; a compile-time
    row shape (D = 64, C = 2, 4 virtual blocks) and a run-time one (D = 12, C = 3)."""
    threads = torch.get_num_threads()
    for shape in ((1 << 17, 64, 2048, 32, 2, 4), (1 << 17, 12, 2048, 32, 3, 1)):
        ((indices, scores, blocks, grad_out),) = batches(shape, 1)
        counts = torch.bincount(indices.flatten(), minlength=shape[0])
        assert 20000 < int((counts[indices.flatten()] > 1).sum()) < 65536 - 30000
        table = make_table(shape)
        results = []
        try:
            for n in (1, 3):
                torch.set_num_threads(n)
                p = torch.nn.Parameter(table.clone())
                update = FusedValueUpdate(p, OPTIMIZERS[kind](p), grad_scale=0.5)
                s = scores.clone().requires_grad_(True)
                lookup_reduce(p, indices, s, blocks, shape[5], backend="cpu", update=update).backward(grad_out)
                results.append((p.data, state_tensors(update.optimizer, p), s.grad, update.pop_sq_norm()))
        finally:
            torch.set_num_threads(threads)
        want, got = results
        assert not torch.equal(want[0], table)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert torch.equal(got[2], want[2])
        assert got[3] == want[3]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_squared_norm_is_the_unfused_gradients(kind):
    """The fused kernel's squared norm of the scaled gradient equals the fp64 sum of the unfused
    gradient's squares within the rounding of its sums (csrc/lookup_reduce_cpu.cpp, add_squares):
    each row's D non-negative squares go to 8 fp32 lanes of D / 8 multiply-adds (at most two
    roundings each), within gamma_(2 D / 8) of exact; the lanes are summed in fp64 over at most
    T K rows (gamma_(T K + 8) in fp64). The grad scale 0.25 is a power of two (exact)."""
    shape = SHAPES[1]
    _, D, T, K = shape[:4]

    def gamma(n, unit):
        return n * unit / (1 - n * unit)

    bound = gamma(2 * D // 8, 2.0**-24) + gamma(T * K + 8, 2.0**-53)
    ((indices, scores, blocks, grad_out),) = batches(shape, 1)
    table = make_table(shape)
    p = torch.nn.Parameter(table.clone())
    lookup_reduce(p, indices, scores, blocks, shape[5], backend="cpu", sparse_grad=True).backward(grad_out)
    want = float(p.grad.coalesce().values().double().pow(2).sum())
    q = torch.nn.Parameter(table.clone())
    update = FusedValueUpdate(q, OPTIMIZERS[kind](q), grad_scale=0.25)
    lookup_reduce(q, indices, scores, blocks, shape[5], backend="cpu", update=update).backward(grad_out)
    got = update.pop_sq_norm()
    assert got == pytest.approx(want * 0.25**2, rel=bound)
    assert update.pop_sq_norm() == 0.0


def gradient_bound(shape, steps):
    """(bound, g_max): a row's gradient is an n-term fp32 sum; summed in two orders, the results
    are within 2 gamma_n of the sum of its terms' magnitudes (Higham Eq. 3.5), n <= all lookups of
    the step; g_max bounds any gradient element."""
    bound = 0.0
    for step in steps:
        p = torch.nn.Parameter(make_table(shape).abs())
        for indices, scores, blocks, grad_out in step:
            lookup_reduce(p, indices, scores.abs(), blocks, shape[5], backend="reference").backward(grad_out.abs())
        n = sum(b[0].numel() for b in step)
        bound = max(bound, 2 * n * 2.0**-24 / (1 - n * 2.0**-24) * float(p.grad.max()))
    g_max = max(float(x[3].abs().max() * x[1].abs().max()) * x[0].numel() for step in steps for x in step)
    return bound, g_max


def assert_steps_agree(kind, p_a, opt_a, p_b, opt_b, bound, g_max):
    """Two trainings of one table whose gradients were summed in different orders (``bound``,
    ``g_max``: :func:`gradient_bound`) agree to what that reordering allows. m moves by
    (1 - beta1) times the gradient's error, v and the Adagrad sum by up to 2 |g| times it; Adam's
    step is lr m / sqrt(v): where the gradient is within its rounding bound of zero the sign, so
    the step, may flip; elsewhere the rows agree to the rounding relative to the step."""
    state_a, state_b = state_tensors(opt_a, p_a), state_tensors(opt_b, p_b)
    for a, b, tol in zip(
        state_a, state_b, (bound, 2 * g_max * bound) if kind == "sparse_adam" else (2 * g_max * bound,)
    ):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2.0**-20, atol=tol)
    keep = state_b[0].cpu().abs() > 10 * bound if kind == "sparse_adam" else slice(None)
    torch.testing.assert_close(p_a.detach().cpu()[keep], p_b.detach().cpu()[keep], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_micro_batches_accumulate_into_one_step(kind, backend):
    """Three micro-batches (``final`` only on the last): one step with their summed gradient, as
    the unfused path accumulates ``.grad`` and steps once. The sums run in another order (one
    sorted pass against per-batch sums added), so equal to fp32 rounding of the gradient."""
    shape = SHAPES[1]
    steps = [batches(shape, 3, seed=s) for s in range(2)]
    table = make_table(shape)
    p_u, opt_u, sg_u, _ = run(table, kind, steps, shape[5], fused=False)
    p_f, opt_f, sg_f, update = run(table, kind, steps, shape[5], fused=True, backend=backend)
    assert update.updates == 2
    assert_steps_agree(kind, p_f, opt_f, p_u, opt_u, *gradient_bound(shape, steps))
    # the first step's score gradients read the same table (bit for bit on the CPU backend: the same
    # dot products); the second's read the stepped rows, equal to the rounding above
    for i, (a, b) in enumerate(zip(sg_f, sg_u)):
        assert torch.equal(a, b) if backend == "cpu" and i < 3 else torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_table_looked_up_twice_in_one_forward_steps_once():
    shape = SHAPES[2]
    (i1, s1, _, g1), (i2, s2, _, g2) = batches(shape, 2)
    table = make_table(shape)
    results = []
    for fused in (False, True):
        p = torch.nn.Parameter(table.clone())
        opt = OPTIMIZERS["rowwise_adagrad"](p)
        update = FusedValueUpdate(p, opt) if fused else None
        loss = sum(
            (lookup_reduce(p, i, s, backend="cpu", sparse_grad=True, update=update) * g).sum()
            for i, s, g in ((i1, s1, g1), (i2, s2, g2))
        )
        loss.backward()
        if not fused:
            opt.step()
        results.append((p.data.clone(), opt.state[p]["sum"].clone(), update))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
    assert results[1][2].updates == 1


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_bf16_table_is_the_fp32_step_rounded_once(kind, shape):
    """A bf16 table with fp32 scores: the fused step is the fp32 one on the same (representable)
    values and state, the new rows rounded once to bf16, the state fp32 and equal."""
    ((indices, scores, blocks, grad_out),) = batches(shape, 1)
    table = make_table(shape, torch.bfloat16)
    out = []
    for t in (table, table.float()):
        p, opt, sg, _ = run(t, kind, [[(indices, scores, blocks, grad_out)]], shape[5], fused=True)
        out.append((p.data, state_tensors(opt, p), sg[0]))
    (narrow, narrow_state, narrow_sg), (wide, wide_state, wide_sg) = out
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, round_fp32(wide, torch.bfloat16))
    for a, b in zip(narrow_state, wide_state):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(narrow_sg, wide_sg)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_torch_reference(kind, table_dtype):
    """The C++ fused step against the plain torch formulation (reference backward, then the torch
    updates of rmt.ops.sparse_optim): within the rounding bounds of tests/kernel_checks.py (the torch
    CPU sqrt is off by an ulp; the gradient sums in another order, within fp32 rounding)."""
    shape = SHAPES[1]
    steps = [[b] for b in batches(shape, 1)]
    table = make_table(shape, table_dtype)
    p_c, opt_c, sg_c, _ = run(table, kind, steps, shape[5], fused=True, backend="cpu")
    p_r, opt_r, sg_r, _ = run(table, kind, steps, shape[5], fused=True, backend="reference")
    x = p_r.data.float()
    rel = ADAM_REL if kind == "sparse_adam" else adagrad_rel(shape[1])
    bound = (rel + 2.0**-20) * (x - table.float()).abs() + 2.0**-21 * x.abs()
    assert_rounded_within(p_c.data, x, bound, what=f"{kind} {table_dtype}")
    for a, b in zip(state_tensors(opt_c, p_c), state_tensors(opt_r, p_r)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(sg_c[0], sg_r[0], rtol=1e-5, atol=1e-5)


def test_score_gradients_alone_equal_the_backwards():
    shape = SHAPES[1]
    ((indices, scores, blocks, grad_out),) = batches(shape, 1)
    table = make_table(shape)
    _, _, want = cpu_backend.backward(grad_out, table, indices, scores, blocks, shape[5])
    assert torch.equal(cpu_backend.score_gradients(grad_out, table, indices, scores, blocks, shape[5]), want)


def test_flush_steps_lookups_left_without_their_final_backward():
    shape = SHAPES[2]
    ((indices, scores, _, grad_out),) = batches(shape, 1)
    table = make_table(shape)
    p = torch.nn.Parameter(table.clone())
    update = FusedValueUpdate(p, OPTIMIZERS["rowwise_adagrad"](p))
    update.final = False
    lookup_reduce(p, indices, scores, backend="cpu", update=update).backward(grad_out)
    assert torch.equal(p.data, table) and len(update.stash) == 1
    update.flush()
    q, _, _, _ = run(table, "rowwise_adagrad", [[(indices, scores, None, grad_out)]], 1, fused=False)
    assert torch.equal(p.data, q.data) and not update.stash


def test_rowwise_adagrad_without_weight_decay_adds_no_term():
    """weight_decay 0 adds no decay term to the fused row-wise Adagrad step, as the reference and
    torch's Adagrad: rows holding infinite weights keep finite gradients and sums
    (kernel_checks.check_fused_zero_decay), where g + 0 * p made them NaN."""
    check_fused_zero_decay("cpu")


def test_rejects_an_optimizer_it_cannot_fuse():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(TypeError, match="SparseAdam or RowWiseAdagrad"):
        FusedValueUpdate(p, torch.optim.SGD([p], lr=0.1))
