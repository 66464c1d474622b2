"""RMT model: reads/writes by hand, the model against a naive per-head reference of §2.2,
shapes, init, config validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.build import build
from rmt.models.rmt import MatrixRMSNorm, RMTModel, alibi_slopes, write

TINY = [
    "model.arch=rmt",
    "model.num_layers=2",
    "model.dk=6",
    "model.dv=4",
    "model.rank=3",
    "model.ffn_hidden_size=20",
    "model.seq_length=12",
    "model.vocab_size=50",
    "model.make_vocab_size_divisible_by=8",
]


def rmt_config(*extra):
    return validate(load_config(None, TINY + list(extra)), world_size=1)


@pytest.fixture(scope="module")
def single_process():
    parallel.initialize(rmt_config())
    yield
    parallel.destroy()


def test_read_write_by_hand():
    # Two data vectors x1, x2 (Dv = 3) stored with keys q1 = e1, q2 = e2 (Dk = 2), Eq. 12.
    data = torch.tensor([[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]])  # [Dv, n]: column h is x_h
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # [Dk, n]: column h is q_h
    X = write(data, keys)  # stored transposed: X[v, k] = sum_h q_h[k] x_h[v]
    assert torch.equal(X, torch.tensor([[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]))
    # Eq. 13 retrieves x_h with q_h; key r = (2, -1) retrieves 2 x1 - x2. The model reads the
    # normalized matrix (unit gain here): X / rms(X), rms^2 = 91 / 6.
    norm = MatrixRMSNorm(dv=3, dk=2, eps=0.0)
    out = norm.read(X[None], torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]]))
    want = torch.tensor([[1.0, 4.0, -2.0], [2.0, 5.0, -1.0], [3.0, 6.0, 0.0]]) / math.sqrt(91 / 6)
    # float32: entries up to 2.1, two products and a sum each after the norm's rounding
    torch.testing.assert_close(out, want, rtol=0, atol=16 * 2.0**-24 * 2.1)
    # A non-orthogonal pair of keys mixes the stored vectors: q1 = (1, 1), q2 = (0, 1).
    X = write(data, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(X, torch.tensor([[1.0, 5.0], [2.0, 7.0], [3.0, 9.0]]))


def test_alibi_slopes_are_geomspace():
    assert torch.allclose(alibi_slopes(4), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]))
    assert torch.allclose(alibi_slopes(12), torch.logspace(-8 / 12, -8, 12, base=2.0))


def _norm(x, gain, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=(-2, -1), keepdim=True) + eps) * gain.view(x.shape[-2:])


def naive_forward(model, cfg, ids):
    """§2.2 written per head with the authors' einsums (docs/reference-implementations.md), residual
    [b,t,Dv,Dk]."""
    m = cfg.model
    R, Dk, Dv, eps = m.rank, m.dk, m.dv, m.layernorm_epsilon
    b, t = ids.shape
    table = model.embedding.word_embeddings.weight.view(-1, Dv, R)
    X = torch.einsum("btvr,kr->btvk", table[ids], model.embedding.word_keys)  # Eq. 18
    if m.position == "learned":
        pos = model.embedding.position_embeddings.weight.view(-1, Dv, R)[:t]
        X = X + torch.einsum("tvr,kr->tvk", pos, model.embedding.position_keys)  # Eq. 19
    dist = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).float()
    causal = dist >= 0
    for layer in model.layers:
        h = _norm(X, layer.attn_norm.weight, eps)
        qkv = torch.einsum("btvk,rck->btcvr", h, layer.attn_read.weight.view(R, 3, Dk))  # Eq. 22
        update = torch.zeros_like(X)
        for r in range(R):
            q, k, v = qkv[:, :, 0, :, r], qkv[:, :, 1, :, r], qkv[:, :, 2, :, r]
            logits = q @ k.transpose(1, 2) / math.sqrt(Dv) / layer.layer_number  # Eq. 21
            if m.position == "alibi":
                logits = logits - alibi_slopes(R)[r] * dist
            p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            update += torch.einsum("btv,k->btvk", p @ v, layer.attn_write.weight[:, r])  # Eq. 20
        X = X + update
        h = _norm(X, layer.ff_norm.weight, eps)
        reads = torch.einsum("btvk,rk->btvr", h, layer.ff_read.weight)  # Eq. 25 (v-major concat)
        y = F.gelu(reads.reshape(b, t, Dv * R) @ layer.fc1.weight.t()) @ layer.fc2.weight.t()  # Eq. 24
        X = X + torch.einsum("btvr,kr->btvk", y.view(b, t, Dv, R), layer.ff_write.weight)  # Eq. 23
    h = _norm(X, model.final_norm.weight, eps)
    reads = torch.einsum("btvk,rk->btvr", h, model.output_layer.read.weight)  # Eq. 27
    return reads.reshape(b, t, Dv * R) @ model.output_layer.linear.weight.t()  # Eq. 26


@pytest.mark.parametrize("position", ["alibi", "learned"])
def test_model_equals_naive_reference(single_process, position):
    cfg = rmt_config(f"model.position={position}")
    model = build(cfg)[0]
    with torch.no_grad():  # the unembedding is zero-initialised; make it count
        model.output_layer.linear.weight.normal_(0, 0.5)
        for layer in model.layers:
            layer.attn_norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None]
    got = model(ids, pos, mask)
    want = naive_forward(model, cfg, ids)
    assert got.shape == (2, 12, 56)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shapes_of_pipeline_stages(single_process):
    cfg = rmt_config()
    ids = torch.randint(0, 50, (3, 12))
    pos = torch.arange(12).expand(3, 12)
    first = RMTModel(cfg, True, False, None)
    hidden = first(ids, pos)
    assert hidden.shape == (12, 3, 6 * 4)  # [s, b, Dk*Dv] for megatron's p2p
    assert first.config.hidden_size == 24 and first.config.num_attention_heads == 3
    assert first.embedding(ids, pos).shape == (12, 3, 4, 6)
    last = RMTModel(cfg, False, True, None)
    last.set_input_tensor([hidden])
    assert last(ids, pos).shape == (3, 12, 56)
    assert [lay.layer_number for lay in last.layers] == [1, 2]


def test_authors_init(single_process):
    cfg = rmt_config("model.num_layers=2", "model.dk=32", "model.dv=16", "model.rank=8", "model.ffn_hidden_size=256")
    model = build(cfg)[0]
    layer = model.layers[0]
    assert torch.count_nonzero(model.output_layer.linear.weight) == 0
    assert torch.equal(layer.attn_norm.weight, torch.ones(32 * 16))
    expected = {
        layer.attn_read.weight: 0.02 / math.sqrt(32),
        layer.fc1.weight: 0.02 / math.sqrt(8 * 16),
        layer.fc2.weight: 0.02 / math.sqrt(256),
        layer.attn_write.weight: 0.02 / math.sqrt(8) / 2.0,
        model.embedding.word_embeddings.weight: 0.02,
    }
    for param, std in expected.items():
        assert abs(param.std().item() / std - 1) < 0.15


def test_rank_not_divisible_by_tp_is_rejected():
    with pytest.raises(
        ConfigError,
        match=r"model.rank \(3\) must be divisible by "
        r"parallel.tensor_model_parallel_size \(2\)",
    ):
        validate(
            load_config(
                None,
                ["model.arch=rmt", "model.rank=3", "model.ffn_hidden_size=64", "parallel.tensor_model_parallel_size=2"],
            ),
            world_size=2,
        )


def test_rmt_positions_and_dropout_are_checked():
    with pytest.raises(ConfigError, match="model.position must be 'alibi' or 'learned' for the rmt"):
        rmt_config("model.position=rope")
    with pytest.raises(ConfigError, match="model.dropout is not supported by the rmt"):
        rmt_config("model.dropout=0.1")
    with pytest.raises(ConfigError, match="model.dk must be an integer > 0, got 0"):
        rmt_config("model.dk=0")


def test_matrix_rmsnorm_matches_torch_and_gradcheck():
    norm = MatrixRMSNorm(3, 5, 1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 2, 3, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (3, 5), norm.weight.view(3, 5), 1e-6))
    # gradcheck perturbs the gain in place, so norm(a) sees every perturbation of g
    assert torch.autograd.gradcheck(lambda a, g: norm(a), (x, norm.weight))


def test_matrix_rmsnorm_bf16_input_keeps_fp32_gain_grad():
    norm = MatrixRMSNorm(4, 8, 1e-6)
    x = torch.randn(6, 4, 8)
    ref = norm(x)
    xb = x.bfloat16().requires_grad_()
    out = norm(xb)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert norm.weight.grad.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
