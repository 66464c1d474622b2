"""The fused CPU matrix RMSNorm, alone and fused with the read after it (csrc/matrix_rmsnorm_cpu.cpp),
against its torch reference (rmt.ops.matrix_rmsnorm) and the float64 truth, forward and backward."""

import pytest
import torch

from rmt.ops.matrix_rmsnorm import FusedMatrixRMSNorm, TorchMatrixRMSNorm, _ext, matrix_rms_norm, matrix_rms_norm_read

pytestmark = pytest.mark.skipif(_ext() is None, reason="the C++ extension did not build")

U = 2.0**-24  # float32 unit roundoff
EPS = 1e-5


def _case(T=200, n=520, dtype=torch.float32, seed=0):
    """x and dy with rows of very different scales; n not a multiple of the kernel's 16 lanes,
    T not a multiple of its 64-row blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, generator=gen, dtype=torch.float64) * torch.logspace(-2, 2, T, dtype=torch.float64)[:, None]
    gain = 1 + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    dy = torch.randn(T, n, generator=gen, dtype=torch.float64)
    return x.to(dtype), gain.to(dtype), dy.to(dtype)


def _run(fn, x, gain, dy):
    x, gain = x.clone().requires_grad_(), gain.clone().requires_grad_()
    y = fn.apply(x, gain, EPS)
    y.backward(dy)
    return y.detach(), x.grad, gain.grad


def _bounds(x, gain, dy, u):
    """First-order error bounds, per element, of a computation with unit roundoff u whose sums of n
    (T) terms are accumulated in any order: gamma_k = k u on sum |terms|."""
    x, gain, dy = x.double(), gain.double(), dy.double()
    T, n = x.shape
    r = (x.square().mean(1, keepdim=True) + EPS).rsqrt()
    g_r = (n + 4) * u  # relative error of r (a sum of n squares, a division, a square root)
    y = (x * r * gain).abs() * (g_r + 3 * u)
    c_abs = (dy * gain * x).abs().sum(1, keepdim=True)
    dx = r * (dy * gain).abs() * (g_r + 3 * u) + r**3 / n * c_abs * x.abs() * (n + 3 * g_r / u + 8) * u
    dg = (r * dy * x).abs().sum(0) * (T + g_r / u + 4) * u
    return y, dx, dg


def test_fused_float32_is_within_rounding_of_the_float64_truth():
    x, gain, dy = _case()
    truth = _run(TorchMatrixRMSNorm, x.double(), gain.double(), dy.double())
    fused = _run(FusedMatrixRMSNorm, x, gain, dy)
    ref = _run(TorchMatrixRMSNorm, x, gain, dy)
    for name, got, want, bound in zip(("y", "dx", "dgain"), fused, truth, _bounds(x, gain, dy, U)):
        assert got.dtype == torch.float32
        excess = ((got.double() - want).abs() - bound).max().item()
        assert excess <= 0, (name, excess)
    for name, got, want, bound in zip(("y", "dx", "dgain"), ref, truth, _bounds(x, gain, dy, U)):
        assert ((got.double() - want).abs() - bound).max().item() <= 0, ("reference", name)


def test_fused_bfloat16_rounds_float32_results_once():
    x, gain, dy = _case(dtype=torch.bfloat16)
    truth = _run(TorchMatrixRMSNorm, x.double(), gain.double(), dy.double())
    fused = _run(FusedMatrixRMSNorm, x, gain, dy)
    for name, got, want, bound in zip(("y", "dx", "dgain"), fused, truth, _bounds(x, gain, dy, U)):
        assert got.dtype == torch.bfloat16
        # float32 arithmetic, then one rounding to bfloat16 (relative 2^-8 of the result)
        excess = ((got.double() - want).abs() - bound - 2.0**-8 * want.abs() * (1 + 1e-3)).max().item()
        assert excess <= 0, (name, excess)


def test_fused_float64_gradients_are_the_derivative():
    x, gain, _ = _case(T=7, n=37, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b: FusedMatrixRMSNorm.apply(a, b, EPS), (x.requires_grad_(), gain.requires_grad_())
    )


def test_results_do_not_depend_on_the_thread_count():
    x, gain, dy = _case(T=1000, n=512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(FusedMatrixRMSNorm, x, gain, dy)
        torch.set_num_threads(3)
        three = _run(FusedMatrixRMSNorm, x, gain, dy)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three):
        assert torch.equal(a, b)


def test_dispatch_and_a_gain_without_gradient():
    x, gain, dy = _case(T=10, n=48)
    xt = x.t().contiguous().t()  # not contiguous: the reference runs
    assert torch.equal(matrix_rms_norm(xt, gain, EPS), TorchMatrixRMSNorm.apply(xt, gain, EPS))
    assert torch.equal(matrix_rms_norm(x, gain, EPS), FusedMatrixRMSNorm.apply(x, gain, EPS))
    x.requires_grad_()
    matrix_rms_norm(x, gain, EPS).backward(dy)
    want = torch.autograd.grad(FusedMatrixRMSNorm.apply(x, gain.clone().requires_grad_(), EPS), x, dy)[0]
    assert gain.grad is None and torch.equal(x.grad, want)
    with pytest.raises(ValueError, match="backend must be one of"):
        matrix_rms_norm(x, gain, EPS, backend="cuda")


def _read_case(T=150, dv=12, dk=20, heads=6, dtype=torch.float32, key_major=False, seed=1):
    """x [T, dv*dk] with rows of different scales (T over two of the kernel's blocks), keys [heads, dk],
    and the read's output gradient in the chosen layout."""
    gen = torch.Generator().manual_seed(seed)
    x, gain, _ = _case(T=T, n=dv * dk, dtype=torch.float64, seed=seed)
    keys = torch.randn(heads, dk, generator=gen, dtype=torch.float64)
    go = torch.randn(*((heads, T * dv) if key_major else (T * dv, heads)), generator=gen, dtype=torch.float64)
    return x.to(dtype), gain.to(dtype), keys.to(dtype), go.to(dtype)


def _run_read(backend, x, gain, keys, go, key_major):
    x, gain, keys = (t.clone().requires_grad_() for t in (x, gain, keys))
    out = matrix_rms_norm_read(x, gain, keys, EPS, key_major, backend=backend)
    out.backward(go)
    return out.detach(), x.grad, gain.grad, keys.grad


def _read_bounds(x, gain, keys, go, key_major, u):
    """First-order bounds of the norm + read: the norm's (:func:`_bounds`, with the read's gradient
    bounded by |go| |keys|), the read's and its gradients' GEMMs (gamma_K on sum |terms|), and the
    norm's error carried through them."""
    x, gain, keys, go = x.double(), gain.double(), keys.double(), go.double()
    T, n = x.shape
    dk, heads = keys.shape[1], keys.shape[0]
    go = (go if not key_major else go.t()).abs()  # [T*dv, heads]
    r = (x.square().mean(1, keepdim=True) + EPS).rsqrt()
    y = (x * r * gain).abs().reshape(-1, dk)
    dy = (go @ keys.abs()).reshape(T, n)  # bounds |dy|
    by, bdx, bdg = _bounds(x, gain, dy, u)
    by = by.reshape(-1, dk)
    e_dy = heads * u * dy  # the GEMM dy = go keys
    out = by @ keys.abs().t() + dk * u * (y @ keys.abs().t())
    dx = bdx + r * (e_dy * gain.abs()) + r**3 / n * x.abs() * (e_dy * (gain * x).abs()).sum(1, keepdim=True)
    dg = bdg + (r * e_dy * x.abs()).sum(0)
    dkeys = go.t() @ by + (T * n // dk + 2) * u * (go.t() @ y)
    return (out.t() if key_major else out), dx, dg, dkeys


@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
@pytest.mark.parametrize(
    "shape", [dict(), dict(dv=7, dk=16), dict(T=151, dv=7, dk=32, heads=5)], ids=["mm", "tiles_dk16", "tiles_dk32"]
)
def test_fused_norm_read_float32_is_within_rounding_of_the_float64_truth(key_major, shape):
    """Dk 20 takes at::mm for the backward's GEMMs; Dk 16 and 32 the register tiles, with a
    remainder of read rows (m = 1050 and 1057) and of keys (6 and 5) against the tiles (4 and 2
    rows or keys with 8 lanes; 8 and 4, then half tiles, with AVX-512's 16)."""
    x, gain, keys, go = _read_case(key_major=key_major, **shape)
    truth = _run_read("torch", x.double(), gain.double(), keys.double(), go.double(), key_major)
    fused = _run_read("cpu", x, gain, keys, go, key_major)
    for name, got, want, bound in zip(
        ("out", "dx", "dgain", "dkeys"), fused, truth, _read_bounds(x, gain, keys, go, key_major, U)
    ):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        excess = ((got.double() - want).abs() - bound * 1.01).max().item()  # 1.01: second-order terms
        assert excess <= 0, (name, excess)


@pytest.mark.parametrize("heads", [2, 3, 4, 5, 6, 8, 12, 16])
def test_fused_norm_read_token_major_is_the_key_major_read_transposed(heads):
    """The token-major forward computes the key-major product and transposes it (block_ops.h,
    with the key count as a compile-time constant for 2, 3, 4, 6, 8, 12 and 16, and read at run
    time otherwise): the same bits as the key-major output's transpose."""
    x, gain, keys, _ = _read_case(T=150, dv=32, dk=16, heads=heads)
    token = matrix_rms_norm_read(x, gain, keys, EPS, key_major=False, backend="cpu")
    key = matrix_rms_norm_read(x, gain, keys, EPS, key_major=True, backend="cpu")
    assert token.shape == (150 * 32, heads) and torch.equal(token, key.t())


@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
def test_fused_norm_read_float64_gradients_are_the_derivative(key_major):
    x, gain, keys, _ = _read_case(T=5, dv=3, dk=4, heads=2, dtype=torch.float64, key_major=key_major)
    assert torch.autograd.gradcheck(
        lambda a, b, c: matrix_rms_norm_read(a, b, c, EPS, key_major, backend="cpu"),
        (x.requires_grad_(), gain.requires_grad_(), keys.requires_grad_()),
    )


@pytest.mark.parametrize("key_major, heads", [(False, 4), (True, 12)], ids=["token_major", "key_major"])
def test_fused_norm_read_does_not_depend_on_the_thread_count(key_major, heads):
    """Bitwise for the output, dx and dgain; dkeys is a GEMM per block (MKL's reduction order
    depends on its thread count, as for every torch weight gradient): within its rounding bound.
    The tiny RMT's shapes: its attention reads key-major with 3R = 12 keys, its feed-forward
    token-major with R = 4 (computed key-major and transposed)."""
    x, gain, keys, go = _read_case(T=300, dv=32, dk=16, heads=heads, key_major=key_major)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_read("cpu", x, gain, keys, go, key_major)
        torch.set_num_threads(3)
        three = _run_read("cpu", x, gain, keys, go, key_major)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one[:3], three[:3]):
        assert torch.equal(a, b)
    bound = _read_bounds(x, gain, keys, go, key_major, U)[3]
    assert ((one[3] - three[3]).abs().double() - 2 * bound).max().item() <= 0


def test_norm_read_dispatch_and_inputs_without_gradient():
    x, gain, keys, go = _read_case(T=10, dv=4, dk=8, heads=3)
    xt = x.t().contiguous().t()  # not contiguous: the reference runs
    assert torch.equal(
        matrix_rms_norm_read(xt, gain, keys, EPS), matrix_rms_norm_read(xt, gain, keys, EPS, backend="torch")
    )
    x.requires_grad_()
    matrix_rms_norm_read(x, gain, keys, EPS).backward(go)
    want = torch.autograd.grad(
        matrix_rms_norm_read(x, gain.clone().requires_grad_(), keys.clone().requires_grad_(), EPS, backend="cpu"), x, go
    )[0]
    assert gain.grad is None and keys.grad is None and torch.equal(x.grad, want)
    with pytest.raises(ValueError, match="backend must be one of"):
        matrix_rms_norm_read(x, gain, keys, EPS, backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key_major", [False, True], ids=["token_major", "key_major"])
def test_norm_read_passing_the_residual_adds_its_gradient_in_the_kernel(key_major, dtype):
    """``pass_residual=True`` returns ``(read, x)``; x's gradient, the norm's plus the one that reached
    x through the residual, is what autograd's separate addition gives, bit for bit (the kernel
    rounds the norm's gradient, then adds), as are the read, the gain's and the keys' gradients.
    The torch backend returns the same pair. A residual gradient of another shape is refused."""
    x0, gain0, _ = _case(T=130, n=512, dtype=dtype)
    keys0 = torch.randn(12, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    read_shape = (12, 130 * 32) if key_major else (130 * 32, 12)
    gen = torch.Generator().manual_seed(4)
    g_read, g_res = torch.randn(read_shape, generator=gen).to(dtype), torch.randn(130, 512, generator=gen).to(dtype)

    def run(passed, backend=None):
        x, gain, keys = (t.clone().requires_grad_() for t in (x0, gain0, keys0))
        if passed:
            out, res = matrix_rms_norm_read(x, gain, keys, EPS, key_major, backend, pass_residual=True)
        else:
            out, res = matrix_rms_norm_read(x, gain, keys, EPS, key_major, backend), x
        torch.autograd.backward((out, res), (g_read, g_res))
        return out.detach(), res.detach(), x.grad, gain.grad, keys.grad

    fused, separate = run(True), run(False)
    for name, a, b in zip(("read", "residual", "dx", "dgain", "dkeys"), fused, separate):
        assert a.dtype == dtype and torch.equal(a, b), name
    assert torch.equal(fused[1], x0)
    if dtype == torch.float32:
        for a, b in zip(run(True, "torch"), run(False, "torch")):
            assert torch.equal(a, b)
    args = (g_read, x0, gain0, keys0, torch.ones(130), key_major, False, False)
    with pytest.raises(RuntimeError, match="grad_residual must be a contiguous tensor of x's shape and dtype"):
        _ext().norm_read_backward(*[a.float() if torch.is_tensor(a) else a for a in args], g_res.float()[:-1])
