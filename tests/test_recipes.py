"""The papers' training recipes: weight decay semantics and the decayed parameter sets
(train.weight_decay_mode, train.decay_rmt_keys) and the feed-forward activation of every
architecture (model.activation)."""

import math
import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.build import build
from rmt.training.ddp import wrap_chunks
from rmt.training.optimizer import build_optimizer, build_scheduler, param_groups

warnings.filterwarnings("ignore")

SCHEDULE = [
    "train.steps=40",
    "train.warmup_steps=10",
    "train.lr=1e-2",
    "train.min_lr_ratio=0.1",
    "train.weight_decay=1e-4",
    "model.vocab_size=300",
]


@pytest.fixture(scope="module")
def single_process():
    parallel.initialize(validate(load_config(None, ["model.vocab_size=300"]), 1))
    yield
    parallel.destroy()


def tanh_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("mode", ["lr", "schedule"])
def test_weight_decay_shrink_per_step(single_process, mode):
    """With zero gradients AdamW's step is the decay alone: ``lr_t * wd`` per step (torch's and
    megatron's AdamW) or ``wd * lr_t / lr`` (decoupled: the RMT authors' 1e-4, 100x more at lr
    1e-2), on a decayed weight of a model trained through megatron's optimizer; an exempt one
    (a norm gain) stays put."""
    config = validate(
        load_config(
            None,
            SCHEDULE
            + [
                f"train.weight_decay_mode={mode}",
                "model.num_layers=1",
                "model.hidden_size=16",
                "model.num_attention_heads=2",
            ],
        ),
        1,
    )
    (chunk,) = wrap_chunks(build(config), config)
    named = dict(chunk.module.named_parameters())
    weight, gain = named["decoder.layers.0.mlp.linear_fc1.weight"], named["decoder.final_layernorm.weight"]
    with torch.no_grad():
        weight.fill_(1.0)
        gain.fill_(1.0)
    optimizer = build_optimizer([chunk], config)
    scheduler = build_scheduler(optimizer, config)
    expected = 1.0
    for step in range(40):
        lr_t = optimizer.param_groups[0]["lr"]
        expected *= 1 - (lr_t * 1e-4 if mode == "lr" else 1e-4 * lr_t / 1e-2)
        chunk.zero_grad_buffer()  # zero gradients
        optimizer.prepare_grads()
        optimizer.step()
        scheduler.step(1)
        torch.testing.assert_close(weight, torch.full_like(weight, expected), rtol=1e-6, atol=0)
        torch.testing.assert_close(gain, torch.ones_like(gain), rtol=0, atol=0)


@pytest.mark.parametrize("decay_keys", [False, True])
def test_rmt_decayed_parameters(single_process, decay_keys):
    overrides = SCHEDULE + [
        "model.arch=rmt",
        "model.position=learned",
        "model.dk=4",
        "model.dv=4",
        "model.rank=2",
        "model.ffn_hidden_size=16",
        "train.weight_decay_mode=schedule",
        f"train.decay_rmt_keys={str(decay_keys).lower()}",
    ]
    config = validate(load_config(None, overrides), 1)
    chunks = build(config)
    names = {id(p): n for n, p in chunks[0].named_parameters()}
    decay, no_decay = param_groups(chunks, config)
    assert decay["weight_decay"] == pytest.approx(1e-4 / 1e-2) and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    keys = {"embedding.word_keys", "embedding.position_keys", "output_layer.read.weight"}
    layers = {
        f"layers.{i}.{w}.weight"
        for i in range(2)
        for w in ("attn_read", "attn_write", "ff_read", "fc1", "fc2", "ff_write")
    }
    assert decayed == layers | (keys if decay_keys else set())
    assert {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "output_layer.linear.weight",
        "layers.0.attn_norm.weight",
    } <= {names[id(p)] for p in no_decay["params"]}


def test_recipe_keys_rejected():
    with pytest.raises(ConfigError, match="^train.weight_decay_mode must be one of 'lr', 'schedule', got 'adam'$"):
        validate(load_config(None, ["train.weight_decay_mode=adam"]), 1)
    with pytest.raises(
        ConfigError,
        match=r"^train.decay_rmt_keys applies to model.arch 'rmt' \(its key "
        r"matrices\), not 'transformer'$",
    ):
        validate(load_config(None, ["train.decay_rmt_keys=true"]), 1)
    with pytest.raises(
        ConfigError,
        match=r"^model.activation must be one of 'gelu', 'gelu_tanh', 'silu', 'relu' or "
        r"null, got 'swish'$",
    ):
        validate(load_config(None, ["model.activation=swish"]), 1)


ARCH = {
    "transformer": ["model.hidden_size=16", "model.num_attention_heads=2"],
    "rmt": ["model.arch=rmt", "model.dk=4", "model.dv=4", "model.rank=2", "model.ffn_hidden_size=16"],
    "recurrent": [
        "model.arch=recurrent",
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.block_width=4",
        "model.seq_length=8",
    ],
    "mixer": ["model.arch=mixer", "model.hidden_size=16", "model.num_attention_heads=2", "model.seq_length=8"],
}


def feed_forward(arch, chunk, activation):
    """(the block's feed-forward on a probe input, the same written out with ``activation``)."""
    x = torch.randn(3, 2, 8 if arch == "rmt" else 16, generator=torch.Generator().manual_seed(1)) * 3
    if arch == "rmt":
        layer = chunk.layers[0]
        h = layer.fc1(x)[0]
        return layer.fc2(layer.activation(h))[0], layer.fc2(activation(h))[0]
    if arch == "mixer":
        block = chunk.layers[0]
        h = block.linear_fc1(block.ffn_norm(x))
        return block.ffn(x), x + block.linear_fc2(activation(h))
    mlp = (chunk.decoder.layers[0] if arch == "transformer" else chunk.layers[0].layer).mlp
    h, bias = mlp.linear_fc1(x)
    return mlp(x)[0], mlp.linear_fc2(activation(h if bias is None else h + bias))[0]


@pytest.mark.parametrize("arch", sorted(ARCH))
@pytest.mark.parametrize("name", [None, "gelu_tanh", "relu"])
def test_activation_of_every_architecture(single_process, arch, name):
    overrides = ["model.vocab_size=300"] + ARCH[arch] + ([f"model.activation={name}"] if name else [])
    chunk = build(validate(load_config(None, overrides), 1))[0]
    with torch.no_grad():  # trained-scale weights: GELU's two forms differ visibly
        for p in chunk.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    default = torch.nn.functional.silu if arch == "mixer" else torch.nn.functional.gelu
    activation = {None: default, "gelu_tanh": tanh_gelu, "relu": torch.relu}[name]
    got, want = feed_forward(arch, chunk, activation)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if name == "gelu_tanh":  # the approximation is distinguishable from the exact GELU here
        _, exact = feed_forward(arch, chunk, torch.nn.functional.gelu)
        assert (got - exact).abs().max() > 1e-5
