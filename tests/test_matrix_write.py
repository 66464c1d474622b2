"""The RMT's write kernel (csrc/matrix_write_cpu.cpp, rmt.ops.matrix_write) against the float64
truth of its reference (F.linear), forward and backward, in both data layouts, with the register
tiles' remainders and several row blocks; its independence of the thread count; the dispatch."""

import pytest
import torch
import torch.nn.functional as F

from rmt.ops.matrix_write import _ext, matrix_write

pytestmark = pytest.mark.skipif(_ext() is None, reason="the C++ extension did not build")

U = 2.0**-24  # float32 unit roundoff


def _case(M, n, dk, key_major, seed=0):
    """data [M, n] (key-major: the transpose of a contiguous [n, M], as the attention's output),
    keys [Dk, n] and the output gradient, float64."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(n, M, generator=gen, dtype=torch.float64)
    data = data.t() if key_major else data.t().contiguous()
    keys = torch.randn(dk, n, generator=gen, dtype=torch.float64)
    grad = torch.randn(M, dk, generator=gen, dtype=torch.float64)
    return data, keys, grad


def _run(data, keys, grad, dtype, backend):
    d = data.t().to(dtype).contiguous().t() if not data.is_contiguous() else data.to(dtype)
    d, k = d.detach().requires_grad_(), keys.to(dtype).detach().requires_grad_()
    out = matrix_write(d, k, backend=backend)
    out.backward(grad.to(dtype))
    return out.detach(), d.grad, k.grad


def _bounds(data, keys, grad, u):
    """First-order bounds of sums of k terms in any order, gamma_k = k u on sum |terms|, plus the
    float32 rounding of the inputs (u relative each)."""
    M, n = data.shape
    dk = keys.shape[0]
    a, k, g = data.abs(), keys.abs(), grad.abs()
    return (n + 2) * u * (a @ k.t()), (dk + 2) * u * (g @ k), (M + 2) * u * (g.t() @ a)


@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
@pytest.mark.parametrize(
    "M, n, dk",
    [(1050, 6, 16), (4099, 5, 32), (4097, 3, 16)],
    ids=["one_block_dk16", "three_blocks_dk32", "three_blocks_dk16"],
)
def test_float32_is_within_rounding_of_the_float64_truth(key_major, M, n, dk):
    """Rows not a multiple of the tiles' 4 (Dk 16) or 2 (Dk 32), keys not a multiple of theirs,
    and more rows than one block of 2048; the data gradient comes back in data's layout."""
    data, keys, grad = _case(M, n, dk, key_major)
    truth = _run(data, keys, grad, torch.float64, "torch")
    got = _run(data, keys, grad, torch.float32, "cpu")
    for name, g, want, bound in zip(("out", "ddata", "dkeys"), got, truth, _bounds(data, keys, grad, U)):
        assert g.dtype == torch.float32 and g.shape == want.shape, name
        excess = ((g.double() - want).abs() - bound * 1.01).max().item()  # 1.01: second-order terms
        assert excess <= 0, (name, excess)
    assert got[1].is_contiguous() != key_major and got[1].t().is_contiguous() == key_major


def test_results_do_not_depend_on_the_thread_count():
    data, keys, grad = _case(5000, 4, 16, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(data, keys, grad, torch.float32, "cpu")
        torch.set_num_threads(3)
        three = _run(data, keys, grad, torch.float32, "cpu")
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three):
        assert torch.equal(a, b)


def test_dispatch():
    """The kernel by default for float32 with Dk 16 or 32 (under CPU autocast to bf16 too: the test
    below); F.linear for other dtypes, other Dk, data in neither layout, and with backend="torch"."""
    data, keys, _ = _case(64, 4, 16, False)
    d32, k32 = data.float(), keys.float()
    assert torch.equal(matrix_write(d32, k32), matrix_write(d32, k32, backend="cpu"))
    for d, k in ((data, keys), (d32[:, :3].contiguous(), torch.randn(20, 3)), (d32[::2], k32)):
        assert torch.equal(matrix_write(d, k), F.linear(d, k))
    assert torch.equal(matrix_write(d32, k32, backend="torch"), F.linear(d32, k32))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 training: the write follows autocast
        got, want = matrix_write(d32, k32), F.linear(d32, k32)
        assert torch.equal(matrix_write(d32[::2], k32), F.linear(d32[::2], k32))  # neither layout
    # oneDNN's bf16 GEMM sums the same exact products in another order: one bf16 rounding apart
    assert got.dtype == torch.bfloat16 and ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs()).all()
    with pytest.raises(ValueError, match="backend must be one of"):
        matrix_write(d32, k32, backend="cuda")


@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
def test_bf16_autocast_runs_the_kernel_on_bf16_rounded_inputs(key_major, monkeypatch):
    """Under CPU autocast to bf16 the write is the float32 kernel on the inputs rounded to bf16 (as
    autocast casts them for F.linear), its output rounded once to bf16: within the bf16 unit
    roundoff 2^-8 of the float64 truth on those inputs plus the float32 sum's gamma_(n+2). The
    gradients are the float32 kernel's on the bf16 output gradient and the rounded inputs, rounded
    to bf16 on their way back through autocast's cast (as F.linear's are): within 2^-8 plus the
    float32 bounds, in data's dtype and layout."""
    import rmt.ops.matrix_write as mw

    calls = []
    apply = mw.FusedMatrixWrite.apply
    monkeypatch.setattr(mw.FusedMatrixWrite, "apply", lambda *a: calls.append(1) or apply(*a))
    data, keys, grad = _case(1050, 4, 16, key_major)
    d = data.t().float().contiguous().t() if key_major else data.float()
    d, k = d.requires_grad_(), keys.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = matrix_write(d, k)
    g = grad.to(torch.bfloat16)
    out.backward(g)
    assert calls == [1] and out.dtype == torch.bfloat16
    db, kb, gd = data.to(torch.bfloat16).double(), keys.to(torch.bfloat16).double(), g.double()
    n, dk, M = db.shape[1], kb.shape[0], db.shape[0]
    truth = db @ kb.t()
    out_bound = 2**-8 * truth.abs() + (n + 2) * U * (db.abs() @ kb.abs().t())
    assert ((out.double() - truth).abs() <= out_bound * 1.01).all()
    for got, want, bound in (
        (d.grad, gd @ kb, (dk + 2) * U * (gd.abs() @ kb.abs())),
        (k.grad, gd.t() @ db, (M + 2) * U * (gd.abs().t() @ db.abs())),
    ):
        assert got.dtype == torch.float32 and torch.equal(got, got.to(torch.bfloat16).float())
        assert ((got.double() - want).abs() <= (2**-8 * want.abs() + bound) * 1.01).all()
    assert d.grad.t().is_contiguous() == key_major


@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
@pytest.mark.parametrize("M, n, dk", [(1050, 6, 16), (4099, 5, 32)], ids=["one_block_dk16", "three_blocks_dk32"])
def test_residual_added_in_the_kernel_is_the_separate_addition(key_major, M, n, dk, monkeypatch):
    """``matrix_write(..., residual=r)`` (the RMT layer's residual add, done as the kernel stores each
    row) equals ``r + matrix_write(...)`` bit for bit, forward and backward: every sum is rounded
    before the addition, as the separate addition rounds it, and the residual's gradient is the
    output's. One kernel call, no separate addition; a residual in a layout the kernel does not
    take (not contiguous) or of another dtype is added after it, as before."""
    import rmt.ops.matrix_write as mw

    data, keys, grad = _case(M, n, dk, key_major)
    d = (data.t().float().contiguous().t() if key_major else data.float()).requires_grad_()
    k = keys.float().requires_grad_()
    r = torch.randn(M, dk, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = grad.float()
    calls = []
    apply = mw.FusedMatrixWrite.apply
    monkeypatch.setattr(mw.FusedMatrixWrite, "apply", lambda *a: calls.append(len(a)) or apply(*a))
    fused = matrix_write(d, k, residual=r)
    fused.backward(g)
    got = [fused.detach(), d.grad, k.grad, r.grad]
    assert calls == [3]
    d.grad = k.grad = r.grad = None
    separate = r + matrix_write(d, k)
    separate.backward(g)
    assert calls == [3, 2]
    for name, a, b in zip(("out", "ddata", "dkeys", "dresidual"), got, (separate.detach(), d.grad, k.grad, r.grad)):
        assert torch.equal(a, b), name
    r_t = r.detach().t().contiguous().t()
    assert torch.equal(matrix_write(d, k, residual=r_t), r_t + matrix_write(d, k)) and calls[-2:] == [2, 2]
    with pytest.raises(RuntimeError, match=r"residual must be a contiguous float32 \[M, Dk\] tensor"):
        _ext().forward(d.detach(), k.detach(), r.detach()[:-1])
