"""Masked and repeat mixers: parallel form against a naive per-position sum, recurrent form
against the parallel form (every head kind, with and without decay), registry and validator."""

import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.build import build
from rmt.models.mixer import head_kinds
from rmt.parallel.sharding import shards

warnings.filterwarnings("ignore")

BASE = [
    "model.arch=mixer",
    "model.vocab_size=16",
    "model.seq_length=12",
    "model.hidden_size=16",
    "model.num_attention_heads=4",
    "model.num_layers=2",
]


def make(*overrides):
    config = validate(load_config(None, BASE + list(overrides)), 1)
    parallel.initialize(config)
    try:
        model = build(config)[0]
    finally:
        parallel.destroy()
    with torch.no_grad():
        for layer in model.layers:
            mixing = layer.mixing
            mixing.token_bias.normal_()
            if mixing.decay is not None:
                mixing.decay.copy_(torch.tensor([0.95, 0.85, 0.99, 1.0]))
    return model.double().eval()


def naive_mixing(mixing, u):
    """``Y_j = sum_{i<=j} W(i, j) g^(j-i) u_i + beta_j`` per head, from the paper's definitions."""
    b, s, heads, c = u.shape
    kinds = head_kinds(mixing.kinds[0] if len(set(mixing.kinds)) == 1 else "mixed", heads)
    w = mixing.token_weight
    g = mixing.gamma()
    out = torch.zeros_like(u)
    for h in range(heads):
        for j in range(s):
            for i in range(j + 1):
                if w.dim() == 3:
                    coef = w[h, i, j]
                else:
                    coef = w[h, i] if kinds[h] == "row" else w[h, j]
                if g is not None:
                    coef = coef * g[h] ** (j - i)
                out[:, j, h] += coef * u[:, i, h]
            out[:, j, h] += mixing.token_bias[h, j]
    return out


CASES = [
    ("masked", False),
    ("row", False),
    ("column", False),
    ("mixed", False),
    ("masked", True),
    ("row", True),
    ("column", True),
    ("mixed", True),
]


@pytest.mark.parametrize("kind,decay", CASES)
def test_parallel_form_equals_naive_sum(kind, decay):
    model = make(f"model.mixer_kind={kind}", f"model.mixer_decay={decay}", "model.mixer_decay_scale=2.0")
    mixing = model.layers[0].mixing
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    u = mixing.split(x)
    expected = mixing.linear_proj(naive_mixing(mixing, u).reshape(2, 12, 16))
    torch.testing.assert_close(mixing(x), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind,decay", [c for c in CASES if c[0] != "masked"])
def test_recurrent_form_equals_parallel_form(kind, decay):
    model = make(f"model.mixer_kind={kind}", f"model.mixer_decay={decay}").float()
    tokens = torch.randint(0, 16, (3, 12))
    with torch.no_grad():
        full = model(tokens)
        state = model.init_state(3)
        steps = []
        for t in range(12):
            logits, state = model.step(tokens[:, t], state, t)
            steps.append(logits)
            assert [tuple(s.shape) for s in state] == [(3, 4, 4)] * 2  # one vector per head per layer
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=0, atol=1e-5)


def test_mixed_heads_are_half_column_half_row():
    assert head_kinds("mixed", 4) == ["column", "column", "row", "row"]
    assert head_kinds("row", 3) == ["row"] * 3


def test_causal_and_block_order():
    model = make("model.mixer_kind=masked")
    tokens = torch.randint(0, 16, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 16
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert (a[:, 7] - b[:, 7]).abs().max() > 1e-6
    names = [n for n, _ in model.layers[0].named_children()]
    assert names.index("ffn_norm") < names.index("mix_norm")  # FFN first, then token mixing


def test_masked_mixer_has_no_recurrent_form():
    model = make("model.mixer_kind=masked")
    with pytest.raises(ValueError, match="no constant-memory recurrent form"):
        model.init_state(1)


def test_every_parameter_is_sharded_and_initialised():
    config = validate(load_config(None, BASE + ["model.mixer_decay=true"]), 1)
    parallel.initialize(config)
    try:
        model = build(config)[0]
        keys = {s.key for s in shards([model])}
    finally:
        parallel.destroy()
    assert len(keys) == len(list(model.parameters()))
    std = model.layers[0].mixing.token_weight.std().item()
    assert 0.5 / 12**0.5 < std < 2 / 12**0.5


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.mixer_kind=diagonal"], "model.mixer_kind must be one of"),
        (["model.mixer_kind=mixed", "model.num_attention_heads=1"], "needs model.num_attention_heads >= 2"),
        (["parallel.tensor_model_parallel_size=2"], "supports data parallelism only"),
        (["model.mixer_decay_scale=0"], "model.mixer_decay_scale must be a finite number > 0, got 0.0"),
    ],
)
def test_validator_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, BASE + overrides), 2)
