"""Row-wise optimizer steps on sparse lookup_reduce gradients: the fused CPU kernels
(csrc/sparse_optim_cpu.cpp) against torch's SparseAdam and the row-wise Adagrad formula, and
on bf16/fp16 tables (fp32 state) against the fp32 step."""

import copy

import pytest
import torch

from rmt.ops import lookup_reduce
from rmt.ops.sparse_optim import (
    ENV_FUSED,
    RowWiseAdagrad,
    SparseAdam,
    _ext,
    coalesced,
    fused_kernels,
    make_sparse_optimizer,
)

from kernel_checks import check_row_optimizer_kernels


def _loss(table, indices, scores, target, sparse_grad):
    out = lookup_reduce(table, indices, scores, sparse_grad=sparse_grad, backend="cpu")
    return (out - target).pow(2).sum()


def _problem(seed=0, N=200, D=12, T=8, K=6):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(N, D, generator=gen)
    indices = torch.randint(0, N, (T, K), generator=gen)
    indices[:, 1] = indices[:, 0]
    return table, indices, gen


def test_sparse_adam_equals_dense_adamw_on_touched_rows():
    table, indices, gen = _problem()
    sparse = torch.nn.Parameter(table.clone())
    dense = torch.nn.Parameter(table.clone())
    opt_sparse = make_sparse_optimizer([sparse], "adam", lr=1e-2)
    opt_dense = torch.optim.AdamW([dense], lr=1e-2, weight_decay=0.0)
    touched = torch.unique(indices)
    untouched = torch.ones(table.shape[0], dtype=torch.bool)
    untouched[touched] = False
    for _ in range(3):
        scores = torch.randn(*indices.shape, 1, generator=gen)
        target = torch.randn(indices.shape[0], 1, table.shape[1], generator=gen)
        for p, opt, sp in ((sparse, opt_sparse, True), (dense, opt_dense, False)):
            opt.zero_grad()
            _loss(p, indices, scores, target, sp).backward()
            assert p.grad.is_sparse == sp
            opt.step()
    # Adam normalizes the step, so rounding in near-zero gradients shows up at ~1e-6.
    torch.testing.assert_close(sparse.data[touched], dense.data[touched], rtol=1e-5, atol=1e-5)
    assert not torch.equal(sparse.data[touched], table[touched])
    assert torch.equal(sparse.data[untouched], table[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_sparse_adam_equals_torch(dtype):
    """Different rows each step (lazy moments of untouched rows), duplicates within a token.
    Not bit-identical: torch's vectorized sqrt is off by up to 1 ulp, the kernel's is exact."""
    assert fused_kernels(torch.zeros(2, 2)) is not None
    table = torch.randn(300, 20, dtype=dtype, generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.nn.Parameter(table.clone()), torch.nn.Parameter(table.clone())
    opts = (
        SparseAdam([ours], lr=3e-2, betas=(0.8, 0.95), eps=1e-6),
        torch.optim.SparseAdam([theirs], lr=3e-2, betas=(0.8, 0.95), eps=1e-6),
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        indices = torch.randint(0, 300, (10, 5), generator=gen)
        scores = torch.randn(10, 5, 1, generator=gen, dtype=dtype)
        target = torch.randn(10, 1, 20, generator=gen, dtype=dtype)
        for p, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            _loss(p, indices, scores, target, True).backward()
            opt.step()
        torch.testing.assert_close(ours.data, theirs.data, rtol=1e-6, atol=1e-6)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opts[0].state[ours][name], opts[1].state[theirs][name], rtol=1e-6, atol=1e-7)
    assert opts[0].state[ours]["step"] == opts[1].state[theirs]["step"] == 4
    assert not torch.equal(ours.data, table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_sparse_adam_reference_is_torch_bit_for_bit(dtype, maximize, monkeypatch):
    """The torch path of rmt's SparseAdam (RMT_SPARSE_OPTIM_FUSED=0: sparse_adam_update_) makes
    torch.optim.SparseAdam's operations in its order: equal bit for bit, state included."""
    monkeypatch.setenv(ENV_FUSED, "0")
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(40, 12, generator=gen, dtype=dtype)
    ours, theirs = torch.nn.Parameter(table.clone()), torch.nn.Parameter(table.clone())
    opts = [
        cls([p], lr=3e-2, betas=(0.8, 0.95), eps=1e-6, maximize=maximize)
        for cls, p in ((SparseAdam, ours), (torch.optim.SparseAdam, theirs))
    ]
    for _ in range(4):
        rows = torch.unique(torch.randint(0, 40, (15,), generator=gen))
        values = torch.randn(rows.numel(), 12, generator=gen, dtype=dtype)
        for p, opt in zip((ours, theirs), opts):
            p.grad = torch.sparse_coo_tensor(rows[None], values, p.shape)
            opt.step()
    assert torch.equal(ours.data, theirs.data) and not torch.equal(ours.data, table)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opts[0].state[ours][name], opts[1].state[theirs][name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernels_on_narrow_tables(dtype):
    """The C++ kernels against the torch references on fp32/bf16/fp16 tables with fp32 state:
    (a) kernel == reference to the stated rounding, (b) a narrow step == the fp32 step rounded
    once (kernel_checks.check_row_optimizer_kernels)."""
    for seed in range(3):
        check_row_optimizer_kernels(_ext(), dtype, seed=seed)


def test_narrow_table_state_is_fp32():
    """rmt's optimizers keep fp32 state for a bf16 table, where torch's SparseAdam keeps the
    parameter's dtype; a training step through lookup_reduce's bf16 sparse gradient keeps it."""
    table = torch.nn.Parameter(torch.randn(30, 8).bfloat16())
    theirs = torch.nn.Parameter(table.detach().clone())
    adam, adagrad = SparseAdam([table], lr=1e-2), RowWiseAdagrad([table], lr=1e-2)
    torch_adam = torch.optim.SparseAdam([theirs], lr=1e-2)
    for p, opts in ((table, (adam, adagrad)), (theirs, (torch_adam,))):
        lookup_reduce(p, torch.tensor([[1, 5], [5, 9]]), torch.randn(2, 2, 1), sparse_grad=True).sum().backward()
        for opt in opts:
            opt.step()
    assert table.grad.dtype == torch.bfloat16 and table.dtype == torch.bfloat16
    assert adam.state[table]["exp_avg"].dtype == adam.state[table]["exp_avg_sq"].dtype == torch.float32
    assert adagrad.state[table]["sum"].dtype == torch.float32
    assert SparseAdam.initial_state(table)["exp_avg"].dtype == torch.float32
    assert torch_adam.state[theirs]["exp_avg"].dtype == torch.bfloat16  # torch's: the parameter's dtype


@pytest.mark.parametrize("cls,kwargs", [(SparseAdam, dict(lr=1e-2)), (RowWiseAdagrad, dict(lr=1e-2))])
def test_load_state_dict_keeps_fp32_state_of_narrow_tables(cls, kwargs):
    """torch's Optimizer.load_state_dict casts state tensors to the parameter's dtype; rmt's
    optimizers load a bf16 table's fp32 state unrounded, and further steps match the original's."""
    gen = torch.Generator().manual_seed(2)
    table = torch.nn.Parameter(torch.randn(20, 6, generator=gen).bfloat16())
    grads = [(torch.unique(torch.randint(0, 20, (8,), generator=gen)), gen) for _ in range(3)]
    grads = [(rows, torch.randn(rows.numel(), 6, generator=gen).bfloat16()) for rows, _ in grads]
    opt = cls([table], **kwargs)
    for rows, values in grads[:2]:
        table.grad = torch.sparse_coo_tensor(rows[None], values, table.shape)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as torch.save + torch.load would (state_dict() aliases the state)
    twin = torch.nn.Parameter(table.detach().clone())
    restored = cls([twin], **kwargs)
    restored.load_state_dict(saved)
    for name, value in opt.state[table].items():
        got = restored.state[twin][name]
        assert got == value if name == "step" else (got.dtype == torch.float32 and torch.equal(got, value))
    rows, values = grads[2]
    for p, o in ((table, opt), (twin, restored)):
        p.grad = torch.sparse_coo_tensor(rows[None], values, p.shape)
        o.step()
    assert torch.equal(twin.data, table.data)


def _tracking_bound_step(narrow, wide, dtype):
    """The bound on |narrow - wide| that one step adds to a touched entry when both paths apply the
    same fp32 update d (Adam's and weight-decay-free Adagrad's updates do not depend on the row):
    the narrow path rounds fl(p_narrow - d) to the table dtype (u |x| <= u/(1-u) |p_narrow|, u =
    2^-8 for bf16, 2^-11 for fp16, plus half a subnormal spacing), and both paths round the
    subtraction in fp32 (2^-24 each, of |x| <= |p_narrow|/(1-u) and of |p_wide|)."""
    u, u32 = torch.finfo(dtype).eps / 2, 2.0**-24
    half_subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps / 2
    return (u / (1 - u) + u32 / ((1 - u32) * (1 - u))) * narrow.abs() + u32 / (1 - u32) * wide.abs() + half_subnormal


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cls,kwargs",
    [(SparseAdam, dict(lr=1e-2, betas=(0.8, 0.95))), (RowWiseAdagrad, dict(lr=0.1))],
    ids=["sparse_adam", "rowwise_adagrad"],
)
def test_narrow_table_tracks_fp32_training(cls, kwargs, dtype, fused, monkeypatch):
    """30 steps on a bf16/fp16 table and on the fp32 table of the same initial values, fed the same
    (representable) sparse gradients: the state is identical and the tables stay within the sum of
    the per-step rounding bounds (_tracking_bound_step), entry by entry."""
    monkeypatch.setenv(ENV_FUSED, fused)
    gen = torch.Generator().manual_seed(6)
    narrow = torch.nn.Parameter(torch.randn(64, 16, generator=gen).to(dtype))
    wide = torch.nn.Parameter(narrow.detach().float())
    opts = cls([narrow], **kwargs), cls([wide], **kwargs)
    bound = torch.zeros(64, 16, dtype=torch.float64)
    for _ in range(30):
        rows = torch.unique(torch.randint(0, 64, (24,), generator=gen))
        values = torch.randn(rows.numel(), 16, generator=gen).to(dtype)
        for p, opt in zip((narrow, wide), opts):
            p.grad = torch.sparse_coo_tensor(rows[None], values.to(p.dtype), p.shape)
            opt.step()
        step_bound = _tracking_bound_step(narrow.detach().double(), wide.detach().double(), dtype)
        bound[rows] += step_bound[rows]
        assert bool(((narrow.detach().double() - wide.detach().double()).abs() <= bound).all())
    for name, value in opts[1].state[wide].items():
        assert (
            opts[0].state[narrow][name] == value if name == "step" else torch.equal(opts[0].state[narrow][name], value)
        )
    assert not torch.equal(narrow.detach().double(), wide.detach().double())  # the roundings did happen


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "torch"])
def test_rowwise_adagrad_matches_formula(fused, monkeypatch):
    monkeypatch.setenv(ENV_FUSED, fused)
    assert (fused_kernels(torch.zeros(2, 2)) is not None) == (fused == "1")
    table, indices, gen = _problem(1)
    param = torch.nn.Parameter(table.clone())
    opt = RowWiseAdagrad([param], lr=0.1, eps=1e-10, weight_decay=0.01)
    want = table.clone().double()
    acc = torch.zeros(table.shape[0], dtype=torch.float64)
    for _ in range(3):
        scores = torch.randn(*indices.shape, 1, generator=gen)
        target = torch.randn(indices.shape[0], 1, table.shape[1], generator=gen)
        opt.zero_grad()
        _loss(param, indices, scores, target, True).backward()
        grad = param.grad.to_dense().double()
        opt.step()
        for r in torch.unique(indices).tolist():
            g = grad[r] + 0.01 * want[r]
            acc[r] += g.pow(2).mean()
            want[r] -= 0.1 * g / (acc[r].sqrt() + 1e-10)
    torch.testing.assert_close(param.data.double(), want, rtol=1e-5, atol=1e-6)
    assert opt.state[param]["sum"].shape == (table.shape[0],)


def test_rowwise_adagrad_dense_grad_and_bad_args():
    p = torch.nn.Parameter(torch.ones(3, 2))
    p.grad = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    RowWiseAdagrad([p], lr=0.5).step()
    torch.testing.assert_close(p.data, torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="lr > 0"):
        RowWiseAdagrad([p], lr=0.0)
    with pytest.raises(ValueError, match="kind must be"):
        make_sparse_optimizer([p], "sgd")


def test_accumulated_lookup_gradient_is_not_sorted_again(monkeypatch):
    """torch's AccumulateGrad drops the coalesced flag of lookup_reduce's sparse gradient;
    ``coalesced`` restores it from the strictly increasing rows instead of sorting again, and
    still coalesces gradients that need it (duplicates, unsorted rows)."""
    table = torch.nn.Parameter(torch.randn(100, 8))
    lookup_reduce(table, torch.tensor([[7, 3], [3, 50]]), torch.ones(2, 2, 1), sparse_grad=True).sum().backward()
    assert not table.grad.is_coalesced()
    want = table.grad.to_dense()
    sort = torch.Tensor.coalesce
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda self: pytest.fail("coalesce() was called"))
    grad = coalesced(table.grad)
    assert grad is table.grad and grad.is_coalesced() and grad.indices()[0].tolist() == [3, 7, 50]
    monkeypatch.setattr(torch.Tensor, "coalesce", sort)
    assert torch.equal(grad.to_dense(), want)
    for rows in ([5, 2, 9], [2, 5, 5]):
        messy = torch.sparse_coo_tensor(torch.tensor([rows]), torch.ones(3, 4), (10, 4))
        got = coalesced(messy)
        assert got.is_coalesced() and torch.equal(got.to_dense(), messy.to_dense())
        assert got.indices()[0].tolist() == sorted(set(rows))
