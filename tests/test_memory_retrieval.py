"""Decoding-speed paths of the retrieval: the grouped top-m equals ``topk`` and TDQKR through
it equals the exact top-m of a rank-1 core on a grid large enough to take that path."""

import torch

from rmt.memory.retrieval import grouped_topk_indices, tucker_topk


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
