"""Memory layers in the Residual Matrix Transformer: the memory reads the flattened residual
matrix (width Dk*Dv) and adds a full-matrix update at skip placements; the RMT + UltraMem
config trains."""

import json
import re

import pytest
import torch
from test_memory_integration import megatron  # noqa: F401  (single-process megatron fixture)

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.memory import pop_aux_loss
from rmt.memory.retrieval import tucker_aux_loss

from conftest import rmt_train, tiny_overrides

RMT = [
    "model.arch=rmt",
    "model.num_layers=3",
    "model.dk=6",
    "model.dv=4",
    "model.rank=2",
    "model.ffn_hidden_size=16",
    "model.seq_length=8",
    "model.vocab_size=50",
    "model.make_vocab_size_divisible_by=8",
    "model.position=alibi",
    "memory.type=ultramem",
    "memory.placement='1:3/2:2'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
]


def _rmt(*extra):
    return validate(load_config(None, RMT + list(extra)), world_size=1)


@pytest.mark.parametrize("kind", ["ultramem", "pkm", "moe"])
def test_rmt_skip_placement_equals_hand_run(megatron, kind):
    from rmt.models.build import build

    cfg = _rmt(f"memory.type={kind}")
    (model,) = build(cfg)
    width = cfg.model.dk * cfg.model.dv
    assert len(model.memory) == 2
    assert model.memory[0].norm.normalized_shape == (width,)
    # The zero-initialised unembedding would make every logit 0 and hide the comparison.
    torch.nn.init.normal_(model.output_layer.linear.weight)
    b, s = 2, cfg.model.seq_length
    tokens = torch.randint(0, 50, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    logits = model(tokens, pos, mask)
    # Hand run: memory 0 reads the matrix after layer 1 and adds after layer 3, memory 1 reads
    # and adds after layer 2; each reads [s, b, Dv*Dk] and its output is the [s, b, Dv, Dk] update.
    for h in model.memory_wiring.handles:
        h.remove()
    bias = model.attention_bias(s, mask, tokens.device)
    layers = model.layers
    x = model.embedding(tokens, pos)
    h1 = layers[0](x, bias)
    h2 = layers[1](h1, bias)
    update1 = model.memory[1](h2.reshape(s, b, width)).reshape(h2.shape)
    update0 = model.memory[0](h1.reshape(s, b, width)).reshape(h1.shape)
    assert update0.abs().amax() > 1e-4 and update1.abs().amax() > 1e-4
    h3 = layers[2](h2 + update1, bias) + update0
    expected = model.output_layer(h3, model.final_norm).transpose(0, 1)
    torch.testing.assert_close(logits, expected)
    aux = pop_aux_loss(model)
    if kind == "ultramem":
        torch.testing.assert_close(aux, sum(tucker_aux_loss(m.cores, 0.001, 0.15) for m in model.memory))
    logits.sum().backward()
    for name, p in model.memory.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_rmt_memory_keys_in_sharded_state_dict(megatron):
    from rmt.models.build import build
    from rmt.parallel.sharding import shards

    (model,) = build(_rmt())
    keys = {s.key for s in shards([model])}
    assert {"memory.0.values.weight", "memory.1.cores", "memory.0.proj"} <= keys
    assert model.memory[0].values.weight.shape == (16, 12)  # num_keys^2 slots, Dk*Dv / 2


def test_rmt_memory_width_is_validated():
    # value dim Dk*Dv/2 = 12 is not divisible by 5 cores (the transformer's hidden_size is unused).
    with pytest.raises(ConfigError, match=re.escape("value dim (12) must be divisible by memory.num_cores (5)")):
        _rmt("memory.num_cores=5")


@pytest.mark.slow
def test_ultramem_rmt_tiny_config_trains(cache_dir, tmp_path, monkeypatch):
    # The in-process group of the megatron fixture holds its MASTER_PORT; the CLI picks its own.
    monkeypatch.delenv("MASTER_PORT", raising=False)
    out = tmp_path / "run.json"
    rmt_train(
        ["--config", "configs/ultramem_rmt_tiny.yaml"]
        + tiny_overrides(cache_dir, steps=8)
        + ["train.lr=1e-2", "train.global_batch_size=2", "--json", str(out)]
    )
    losses = [h["lm loss"] for h in json.loads(out.read_text())["history"]]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.5
