"""Recurrent transformer: eqs. 6-8 against an explicit composition of the shared layer, k = l,
causality, lengths not divisible by k, the accumulation parameter's range, validator."""

import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.build import build
from rmt.models.recurrent import window_mask
from rmt.parallel.sharding import shards

warnings.filterwarnings("ignore")

BASE = [
    "model.arch=recurrent",
    "model.vocab_size=16",
    "model.seq_length=16",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.num_layers=1",
    "model.block_width=4",
]


@pytest.fixture
def built():
    def make(*overrides):
        config = validate(load_config(None, BASE + list(overrides)), 1)
        parallel.initialize(config)
        return build(config)[0]

    yield make
    parallel.destroy()


def tau(layer, x):
    return layer.layer(x, attention_mask=window_mask(x.shape[0], x.device))[0]


def test_two_blocks_follow_equations_6_to_8(built):
    layer = built("model.recurrent_alpha=0.3").layers[0]
    x = torch.randn(8, 2, 16)
    x1, x2 = x[:4], x[4:]
    h1 = tau(layer, x1)  # eq. 6
    y1, h2 = tau(layer, torch.cat([0.3 * x1 + h1, 0.3 * x1 + x2])).split(4)  # eq. 7
    y2 = tau(layer, h2)  # eq. 8
    torch.testing.assert_close(layer(x), torch.cat([y1, y2]), rtol=0, atol=1e-6)


def test_block_width_equal_to_length_is_the_layer_applied_twice(built):
    layer = built("model.block_width=16").layers[0]
    x = torch.randn(16, 2, 16)
    torch.testing.assert_close(layer(x), tau(layer, tau(layer, x)), rtol=0, atol=1e-6)


def test_causal_and_length_not_divisible_by_block_width(built):
    model = built().eval()
    tokens = torch.randint(0, 16, (2, 16))
    with torch.no_grad():
        full = model(tokens)
        short = model(tokens[:, :13])  # 13 = 3 blocks of 4 + 1, right-padded internally
        changed = tokens.clone()
        changed[:, 9] = (changed[:, 9] + 1) % 16
        other = model(changed)
    assert short.shape == (2, 13, 128)
    torch.testing.assert_close(short, full[:, :13], rtol=0, atol=1e-5)
    torch.testing.assert_close(other[:, :9], full[:, :9], rtol=0, atol=1e-5)
    assert (other[:, 9] - full[:, 9]).abs().max() > 1e-4


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_alpha_stays_in_its_interval_under_training(built, floor):
    """Steps far past either end leave α clamped to [model.recurrent_alpha_min, 1]."""
    model = built("model.recurrent_alpha=0.9", f"model.recurrent_alpha_min={floor}")
    layer = model.layers[0]
    assert layer.alpha.requires_grad
    tokens = torch.randint(0, 16, (2, 16))
    seen = []
    for _ in range(4):
        layer.alpha.grad = None
        model(tokens).float().pow(2).mean().backward()
        assert layer.alpha.grad is not None and layer.alpha.grad != 0
        with torch.no_grad():
            layer.alpha -= 0.7 * layer.alpha.grad.sign()  # steps far past the interval's ends
        seen.append(float(layer.accumulation()))
    assert all(floor <= a <= 1.0 for a in seen)
    assert floor in seen or 1.0 in seen
    for pushed, clamped in ((-5.0, floor), (5.0, 1.0)):
        layer.alpha.data.fill_(pushed)
        assert float(layer.accumulation()) == clamped


def test_frozen_alpha_and_every_parameter_sharded(built):
    model = built("model.recurrent_alpha_learned=false", "model.recurrent_alpha=0.0", "model.num_layers=2")
    assert not model.layers[0].alpha.requires_grad and float(model.layers[1].alpha) == 0.0
    keys = {s.key for s in shards([model])}
    assert "layers.1.alpha" in keys and len(keys) == len(list(model.parameters()))


def test_block_positions_make_every_block_alike(built):
    """``model.position=block``: a table of k rows indexed by position mod k, so the logits of a
    sequence do not change when its positions move by whole blocks (they do with ``learned``),
    and equal those of explicit ids mod k."""
    tokens = torch.randint(0, 16, (2, 12))
    positions = torch.arange(12)[None].expand(2, -1)
    for position, moves in (("block", False), ("learned", True)):
        model = built(f"model.position={position}").eval()
        with torch.no_grad():
            here, later = model(tokens, positions), model(tokens, positions + 4)
            wrapped = model(tokens, positions % 4)
        assert model.position_embedding.num_embeddings == (4 if position == "block" else 16)
        assert ((later - here).abs().max() > 1e-3) == moves
        if not moves:
            torch.testing.assert_close(later, here, rtol=0, atol=0)
            torch.testing.assert_close(wrapped, here, rtol=0, atol=0)
        parallel.destroy()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.block_width=32"], "must not exceed model.seq_length"),
        (["model.recurrent_alpha=1.5"], "model.recurrent_alpha must be a finite number in \\[0, 1\\], got 1.5"),
        (
            ["model.recurrent_alpha=0.3", "model.recurrent_alpha_min=0.4"],
            r"model.recurrent_alpha_min must lie in \[0, model.recurrent_alpha = 0.3\], got 0.4",
        ),
        (["parallel.pipeline_model_parallel_size=2", "model.num_layers=2"], "supports data parallelism only"),
        (["model.position=rope"], "must be 'learned' or 'block'"),
    ],
)
def test_validator_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, BASE + overrides), 2)
