"""UltraMem / PKM layer components against naive dense computations (arXiv 2411.12364 §3)."""

import math
import os

import pytest
import torch

from rmt.memory.layer import MemoryLayer, MemorySpec
from rmt.memory.retrieval import expected_topm_mean, product_topk, tucker_aux_loss, tucker_topk

from conftest import memory_spec


def _spec(**kw):
    base = dict(
        hidden_size=16,
        num_heads=2,
        topk=4,
        key_dim=8,
        num_keys=6,
        retrieval="tucker",
        tucker_rank=2,
        num_cores=2,
        ive_blocks=4,
        init_samples=2,
    )
    base.update(kw)
    return memory_spec(**base)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = MemoryLayer(_spec(**kw)).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))  # break the identity conv / constant gains
    return layer


def _exact_grid(s_row, s_col, cores):
    """All n*n grid scores S_row^T C^(i) S_col: [T, H, n*n, h]."""
    return torch.einsum("thai,hkab,thbj->thijk", s_row, cores, s_col).flatten(2, 3)


def test_tdqkr_two_phase_equals_exact_topm_for_rank1_core():
    torch.manual_seed(0)
    T, H, r, n, m, h = 5, 2, 3, 20, 6, 2
    s_row, s_col = torch.randn(T, H, r, n, dtype=torch.float64), torch.randn(T, H, r, n, dtype=torch.float64)
    u, t = torch.randn(H, r, 1, dtype=torch.float64), torch.randn(H, 1, r, dtype=torch.float64)
    weights = torch.tensor([0.7, 0.3], dtype=torch.float64).view(1, h, 1, 1)
    cores = (u @ t).unsqueeze(1) * weights  # every core (and their sum) has rank 1
    addr, scores = tucker_topk(s_row, s_col, cores, m)
    full = _exact_grid(s_row, s_col, cores)
    best, pos = full.sum(-1).topk(m, dim=-1)
    assert (best[..., -1] > 0).all()  # the exactness condition of tucker_topk
    assert torch.equal(addr.sort(-1).values, pos.sort(-1).values)
    expected = full.gather(2, addr.unsqueeze(-1).expand(-1, -1, -1, h))
    torch.testing.assert_close(scores, expected)  # MCS: each core's own score map (Eq. 16)
    torch.testing.assert_close(scores.sum(-1), best)


def test_tdqkr_full_rank_scores_are_exact_at_selected_addresses():
    torch.manual_seed(1)
    s_row, s_col = torch.randn(3, 1, 2, 12), torch.randn(3, 1, 2, 12)
    cores = torch.randn(1, 2, 2, 2)
    addr, scores = tucker_topk(s_row, s_col, cores, 4)
    full = _exact_grid(s_row, s_col, cores)
    torch.testing.assert_close(scores, full.gather(2, addr.unsqueeze(-1).expand(-1, -1, -1, 2)))
    assert (scores.sum(-1)[..., :-1] >= scores.sum(-1)[..., 1:]).all()


def test_product_keys_two_phase_is_exact():
    torch.manual_seed(2)
    s_row, s_col = torch.randn(4, 2, 1, 15), torch.randn(4, 2, 1, 15)
    addr, scores = product_topk(s_row, s_col, 5)
    full = (s_row[:, :, 0, :, None] + s_col[:, :, 0, None, :]).flatten(2)
    best, pos = full.topk(5, dim=-1)
    assert torch.equal(addr, pos)
    torch.testing.assert_close(scores[..., 0], best)


def _naive_output(layer, h, softmax=False):
    """Dense reference of the pooling: explicitly expanded virtual table V~_p = V W_p (Eq. 13),
    split by core columns (Eq. 17), indexed by the shuffled virtual address (Eq. 14)."""
    s = layer.spec
    addr, scores = layer.retrieve(h)  # softmax already applied by the layer when enabled
    V, E, C = layer.values.weight, s.ive_blocks, s.num_cores
    cols = V.shape[1] // C
    virtual = layer.shuffle(addr) if layer.shuffle is not None else addr
    W = layer.proj if layer.has_proj else torch.eye(s.hidden_size, dtype=V.dtype).unsqueeze(0)
    out = torch.zeros(h.shape[0], s.hidden_size, dtype=V.dtype)
    for c in range(C):
        sl = slice(c * cols, (c + 1) * cols)
        expanded = torch.cat([V[:, sl] @ W[p, sl] for p in range(E)])  # [E*N, hidden], block-major
        out = out + (scores[..., c : c + 1] * expanded[virtual]).sum(1)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # TDQKR + MCS + IVE (shuffled)
        dict(ive_shuffle=False),
        dict(num_cores=1, ive_blocks=1),  # half value dim + output projection
        dict(type="pkm", key_dim=16),  # PKM: product keys of width 8 per side, softmax, value dim 16
    ],
)
def test_layer_equals_expanded_split_tables(kw):
    layer = _layer(**kw)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    out = layer(x)
    h = layer.query_input(x).reshape(10, 16)
    torch.testing.assert_close(out.reshape(10, 16), _naive_output(layer, h))


def test_pkm_against_full_dense_scores_with_softmax():
    layer = _layer(type="pkm", key_dim=16)
    assert not layer.has_proj
    x = torch.randn(3, 1, 16, dtype=torch.float64)
    h = layer.norm(x).reshape(3, 16)
    q = layer.query(h).view(3, 2, 2, 8)
    row = torch.einsum("thd,hnd->thn", q[:, :, 0], layer.keys[:, 0, 0])
    col = torch.einsum("thd,hnd->thn", q[:, :, 1], layer.keys[:, 1, 0])
    full = (row[..., :, None] + col[..., None, :]).flatten(2)  # every one of the n*n slots
    best, idx = full.topk(4, dim=-1)
    w = torch.softmax(best, -1)  # Lample et al.: softmax over the top-k, per head
    expected = (w.unsqueeze(-1) * layer.values.weight[idx]).sum((1, 2))
    torch.testing.assert_close(layer(x).reshape(3, 16), expected)


def test_softmax_switch():
    with_sm, without = _layer(softmax=True), _layer(softmax=False)
    h = torch.randn(6, 16, dtype=torch.float64)
    _, s_sm = with_sm.retrieve(h)
    _, s_raw = without.retrieve(h)
    per_head = s_sm.view(6, 2, 4, 2)
    torch.testing.assert_close(per_head.sum(2), torch.ones(6, 2, 2, dtype=torch.float64))
    torch.testing.assert_close(per_head, torch.softmax(s_raw.view(6, 2, 4, 2), dim=2))


def test_query_conv_is_causal_and_decoding_matches():
    layer = _layer(conv_kernel=3)
    x = torch.randn(7, 2, 16, dtype=torch.float64)
    full = layer(x)
    changed = x.clone()
    changed[4:] = torch.randn(3, 2, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(changed)[:4], full[:4])
    assert not torch.allclose(layer(changed)[4:], full[4:])
    state = {}
    steps = torch.cat([layer(x[t : t + 1], state) for t in range(7)])
    torch.testing.assert_close(steps, full)


def test_gradients_reach_every_parameter():
    layer = _layer()
    layer(torch.randn(4, 2, 16, dtype=torch.float64)).square().sum().backward()
    for name in (
        "keys",
        "cores",
        "proj",
        "values.weight",
        "query.weight",
        "conv",
        "query_norm.weight",
        "key_norm.weight",
        "norm.weight",
    ):
        g = dict(layer.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name


def test_aux_loss_eq12():
    core = torch.diag_embed(torch.tensor([[2.0, 0.1, 0.05]])).unsqueeze(1)  # [H=1, h=1, 3, 3]
    assert tucker_aux_loss(core, 0.001, 0.15).item() == 0.0  # non-leading values under tau
    core = torch.diag_embed(torch.tensor([[2.0, 0.5, 0.25]])).unsqueeze(1).requires_grad_()
    loss = tucker_aux_loss(core, 0.001, 0.15)
    assert loss.item() == pytest.approx(0.001 / 2 * ((0.5 - 0.15) ** 2 + (0.25 - 0.15) ** 2))
    loss.backward()
    assert core.grad.abs().sum() > 0
    assert tucker_aux_loss(torch.randn(2, 2, 1, 1), 0.001, 0.0).item() == 0.0  # r = 1


def test_improved_init_appendix_a():
    s = _spec()
    layer = MemoryLayer(s)
    E_Y = expected_topm_mean(s.grid**2, s.topk, s.init_samples, seed=s.seed)
    assert layer.query_norm.weight[0].item() == pytest.approx(1 / math.sqrt(E_Y))
    assert layer.key_norm.weight[0].item() == pytest.approx(1 / math.sqrt(s.side_dim // s.tucker_rank))
    assert s.value_std == pytest.approx(math.sqrt(4 / (2 * 4 * 2 * 2)))
    big = expected_topm_mean(10000, 1, 8)
    assert 3.3 < big < 4.3  # E[max of 1e4 normals] ~ 3.85


def test_value_init_std_overrides_appendix_a():
    assert _spec(value_init_std=0.02).value_std == 0.02
    assert _spec(value_init_std=0.02, improved_init=False).value_std == 0.02
    assert _spec(improved_init=False).value_std == pytest.approx(1 / math.sqrt(8))  # Lample: 1/sqrt(value dim)


def test_tiny_config_memory_output_at_init_is_the_mlps_scale():
    """configs/ultramem_tiny.yaml draws its values at 0.02 (the authors' code), not Appendix A's
    sqrt(E / (2 m H L)) = 0.25: the output is linear in the values, so it is 0.02 / 0.25 of the
    Appendix A layer's on the same draw, ~0.04 RMS (the dense MLP's output at init is ~0.026,
    the residual stream ~0.04) instead of Appendix A's sqrt(1 / (2L)) = 0.5."""
    from rmt.config import load_config
    from rmt.config_checks import validate

    from conftest import ROOT

    def layer(*overrides):
        config = validate(
            load_config(os.path.join(ROOT, "configs", "ultramem_tiny.yaml"), list(overrides)), world_size=1
        )
        torch.manual_seed(0)
        return MemoryLayer(MemorySpec.from_config(config))

    tiny, appendix_a = layer(), layer("memory.value_init_std=null")
    assert tiny.spec.value_std == 0.02 and appendix_a.spec.value_std == pytest.approx(0.25)
    x = torch.randn(128, 8, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = tiny(x), appendix_a(x)
    torch.testing.assert_close(out, ref * (0.02 / 0.25), rtol=1e-5, atol=1e-7)
    assert 0.02 < out.pow(2).mean().sqrt().item() < 0.06
    assert ref.pow(2).mean().sqrt().item() > 0.35


def test_slot_statistics():
    layer = _layer().train()
    x = torch.randn(4, 2, 16, dtype=torch.float64)
    layer(x)
    slots, _ = layer.physical(layer.retrieve(layer.query_input(x).reshape(8, 16))[0])
    stats = layer.pop_stats()
    assert stats["slot_hit_fraction"] == pytest.approx(slots.unique().numel() / layer.spec.num_values)
    assert stats["top1_score_max"] >= stats["top1_score_mean"] >= stats["topm_score_mean"]
    assert layer.pop_stats()["slot_hit_fraction"] == 0.0
