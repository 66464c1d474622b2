"""The retrieval's pieces: TDQKR equals the exact top-m of a rank-1 core on a large grid, the
closed-form rank-2 singular vectors and values equal the SVD's, and a memory layer without
autograd (cached weight terms) equals the layer with autograd, also after its weights change."""

import torch

from rmt.memory.layer import MemoryLayer
from rmt.memory.retrieval import leading_singular_vectors, singular_values, tucker_topk

from conftest import memory_spec


def test_tucker_topk_exact_for_rank1_core_on_large_grid():
    gen = torch.Generator().manual_seed(1)
    T, H, r, n, m = 4, 2, 2, 64, 5
    s_row, s_col = torch.randn(T, H, r, n, generator=gen), torch.randn(T, H, r, n, generator=gen)
    u, t = torch.randn(H, r, generator=gen), torch.randn(H, r, generator=gen)
    cores = torch.stack([torch.outer(u[h], t[h]) for h in range(H)]).unsqueeze(1).repeat(1, 2, 1, 1) / 2
    addr, scores = tucker_topk(s_row, s_col, cores, m)
    full = torch.einsum("thai,hab,thbj->thij", s_row, cores.sum(1), s_col).flatten(2)
    best, want = full.topk(m, dim=-1)
    assert (best[..., -1] > 0).all()
    assert torch.equal(addr, want)
    per_core = torch.einsum("thai,hkab,thbj->thijk", s_row, cores, s_col).flatten(2, 3)
    torch.testing.assert_close(scores, per_core.gather(2, want.unsqueeze(-1).expand(-1, -1, -1, 2)))


def _rank2_cores(n=2000, dtype=torch.float64):
    """Random 2 x 2 cores, with rank-1 and near-rank-1 ones among them (where training's
    auxiliary loss drives them)."""
    gen = torch.Generator().manual_seed(3)
    c = torch.randn(n, 2, 2, generator=gen, dtype=torch.float64)
    u, t = torch.randn(2, 200, 2, generator=gen, dtype=torch.float64)
    c[:200] = u[:, :, None] * t[:, None, :]
    c[200:400] = c[:200] + 1e-3 * torch.randn(200, 2, 2, generator=gen, dtype=torch.float64)
    return c.to(dtype)


def test_rank2_leading_singular_vectors_are_the_svds():
    """The closed form (no host wait on a GPU) against fp64 SVDs of the same fp32 cores, up to
    sign: u is the leading eigenvector of C C^T, whose entries carry an fp32 rounding of about
    eps * sigma_1^2, so its angle is off by about that over the eigen-gap sigma_1^2 - sigma_2^2
    (16 eps of it allowed; t = C^T u / |C^T u| follows u). Rank 3 still goes through the SVD."""
    cores = _rank2_cores(dtype=torch.float32)
    u, t = leading_singular_vectors(cores)
    U, S, Vh = torch.linalg.svd(cores.double())
    bound = 16 * torch.finfo(torch.float32).eps * S[:, 0] ** 2 / (S[:, 0] ** 2 - S[:, 1] ** 2)
    for got, want in ((u, U[:, :, 0]), (t, Vh[:, 0, :])):
        sign = torch.sign((got.double() * want).sum(-1, keepdim=True))
        assert ((got.double() - sign * want).abs().amax(-1) <= bound).all()
    assert u.dtype == t.dtype == torch.float32 and torch.equal(u.norm(dim=-1).round(decimals=5), torch.ones(2000))
    three = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(4))
    U, _, Vh = torch.linalg.svd(three)
    got = leading_singular_vectors(three)
    assert torch.equal(got[0], U[..., :, 0]) and torch.equal(got[1], Vh[..., 0, :])


def test_rank2_singular_values_and_their_gradient_are_the_svds():
    """fp64: the values within a few roundings of sigma_1 (8 eps sigma_1), the gradient of the
    auxiliary loss's term (sigma_2) within a few roundings of the SVD's u_2 v_2^T (entries at most
    1: 64 eps). Where the formula's square roots meet zero (C = 0, a rotation times a scale, a
    symmetric reflection) the gradient stays finite."""
    cores = _rank2_cores()
    eps = torch.finfo(torch.float64).eps
    got = singular_values(cores)
    want = torch.linalg.svdvals(cores)
    assert ((got - want).abs() <= 8 * eps * want[:, :1]).all()
    a, b = cores[400:].clone().requires_grad_(True), cores[400:].clone().requires_grad_(True)
    singular_values(a)[:, 1].sum().backward()
    torch.linalg.svdvals(b)[:, 1].sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=64 * eps)
    special = torch.tensor(
        [[[0.0, 0.0], [0.0, 0.0]], [[3.0, -1.0], [1.0, 3.0]], [[1.0, 2.0], [2.0, -1.0]], [[1.0, 0.0], [0.0, 1.0]]],
        dtype=torch.float64,
        requires_grad=True,
    )
    values = singular_values(special)
    # the clamp at the smallest normal number adds at most twice its square root (C = 0 here)
    want = torch.linalg.svdvals(special.detach())
    assert ((values.detach() - want).abs() <= 8 * eps * want[:, :1] + 2 * torch.finfo(torch.float64).tiny ** 0.5).all()
    values.sum().backward()
    assert torch.isfinite(special.grad).all()


def test_layer_without_autograd_equals_training_path_and_follows_weight_changes():
    spec = memory_spec(
        hidden_size=32,
        num_heads=2,
        topk=4,
        key_dim=8,
        num_keys=8,
        tucker_rank=2,
        num_cores=2,
        ive_blocks=4,
        init_samples=2,
    )
    torch.manual_seed(0)
    layer = MemoryLayer(spec).eval()
    x = torch.randn(1, 6, 32)

    def both_paths():
        with torch.no_grad():
            fast = layer(x)
        with torch.inference_mode():
            again = layer(x)
        slow = layer(x)  # autograd on: weight terms recomputed from the parameters
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)
        torch.testing.assert_close(again, slow, rtol=0, atol=1e-6)
        return slow.detach()

    before = both_paths()
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05)
    layer(x).square().sum().backward()
    opt.step()
    after = both_paths()
    assert not torch.allclose(before, after, atol=1e-3)
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in layer.state_dict().items()}
    layer.load_state_dict(state)
    assert not torch.allclose(both_paths(), after, atol=1e-3)
