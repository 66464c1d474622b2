"""Row-wise optimizer steps on sparse lookup_reduce gradients: the fused CPU kernels
(csrc/sparse_optim_cpu.cpp) against torch's SparseAdam and the row-wise Adagrad formula."""

import pytest
import torch

from rmt.ops import lookup_reduce
from rmt.ops.sparse_optim import (ENV_FUSED, RowWiseAdagrad, SparseAdam, coalesced, fused_kernels,
                                  make_sparse_optimizer)


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
    table = torch.randn(300, 20, dtype=dtype)
    ours, theirs = torch.nn.Parameter(table.clone()), torch.nn.Parameter(table.clone())
    opts = (SparseAdam([ours], lr=3e-2, betas=(0.8, 0.95), eps=1e-6),
            torch.optim.SparseAdam([theirs], lr=3e-2, betas=(0.8, 0.95), eps=1e-6))
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
