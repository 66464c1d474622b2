"""Decoding-speed paths of the retrieval: the grouped top-m equals ``topk``, TDQKR through it
equals the exact top-m of a rank-1 core on a grid large enough to take that path, the fused CPU
selection equals the torch one, and a memory layer without autograd (cached weight terms) equals
the layer with autograd, also after its weights change."""

import pytest
import torch

from rmt.memory.layer import MemoryLayer, MemorySpec
from rmt.memory.retrieval import _select_ext, grouped_topk_indices, rank1_selector, tucker_select, tucker_topk


def test_grouped_topk_equals_topk():
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(0))
    for m in (1, 5, 11):
        assert torch.equal(grouped_topk_indices(x, m), x.topk(m, dim=-1).indices)
    odd = torch.randn(4, 90)  # not a multiple of the group: plain topk
    assert torch.equal(grouped_topk_indices(odd, 3), odd.topk(3, dim=-1).indices)


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


@pytest.mark.parametrize("dtype,n,m", [(torch.float64, 200, 7), (torch.float32, 96, 16),
                                       (torch.float64, 20, 16), (torch.float64, 4, 16)])
def test_fused_selection_equals_torch(dtype, n, m):
    """Same rows/cols in the same (best-first) order; the last two keep all n candidates (2m >= n),
    the last with fewer than 2m grid entries.
    Inputs are non-contiguous views, as the layer passes them."""
    assert _select_ext() is not None
    gen = torch.Generator().manual_seed(n)
    T, H, r = 9, 3, 2
    both = torch.randn(T, H, 2, r, n, generator=gen, dtype=torch.float64).to(dtype)
    cores = torch.randn(H, 2, r, r, generator=gen, dtype=torch.float64).to(dtype)
    sel = rank1_selector(cores)
    fused = tucker_select(both[:, :, 0], both[:, :, 1], sel, m, backend="cpu")
    ref = tucker_select(both[:, :, 0], both[:, :, 1], sel, m, backend="torch")
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
    addr, scores = tucker_topk(both[:, :, 0], both[:, :, 1], cores, m, backend="cpu")
    addr_ref, scores_ref = tucker_topk(both[:, :, 0], both[:, :, 1], cores, m, backend="torch")
    assert torch.equal(addr, addr_ref)
    torch.testing.assert_close(scores, scores_ref)
    with pytest.raises(ValueError, match="backend must be one of"):
        tucker_select(both[:, :, 0], both[:, :, 1], sel, m, backend="cuda")


def test_layer_without_autograd_equals_training_path_and_follows_weight_changes():
    spec = MemorySpec(hidden_size=32, num_layers=2, num_heads=2, topk=4, side_dim=8, num_keys=8,
                      tucker_rank=2, num_cores=2, ive_blocks=4, init_samples=2)
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
