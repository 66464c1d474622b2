"""PKM as published (Lample et al. 2019; XLM's HashingMemory): query bias and query BatchNorm.

The layer against a direct reference of the published forward with torch's BatchNorm1d; the
running statistics against BatchNorm1d's over the same microbatches; data, tensor and pipeline
parallel training == the single-process run (losses, gradients, weights, the running
statistics on every rank and the validation loss, which uses them)."""

import warnings

import pytest
import torch

from rmt.memory.batchnorm import QueryBatchNorm, sync_running_stats
from rmt.memory.layer import MemoryLayer

from conftest import memory_spec, tiny_overrides, train_cases

warnings.filterwarnings("ignore")

PKM = ["memory.type=pkm", "memory.key_dim=8", "memory.num_keys=4", "memory.topk=3", "memory.num_heads=2"]
PUBLISHED = ["memory.query_batchnorm=true", "memory.query_bias=true"]


def pkm_layer():
    spec = memory_spec(
        type="pkm",
        hidden_size=16,
        num_heads=2,
        topk=3,
        key_dim=8,
        num_keys=6,
        query_batchnorm=True,
        query_bias=True,
        seed=5,
    )
    layer = MemoryLayer(spec)
    with torch.no_grad():
        layer.query.bias.normal_(0, 0.3)
        layer.query_bn.weight.normal_(1, 0.2)
        layer.query_bn.bias.normal_(0, 0.2)
    return layer


def published_pkm(layer, x, bn):
    """XLM's HashingMemory forward written out: query = BN(Linear(x)) split per head into row and
    column halves, top-k per half, top-k of the k x k sums, softmax, weighted sum of values."""
    spec = layer.spec
    h = layer.norm(x).reshape(-1, spec.hidden_size)
    q = bn(torch.nn.functional.linear(h, layer.query.weight, layer.query.bias))
    q = q.view(h.shape[0], spec.num_heads, 2, spec.side_dim)
    values = layer.values.weight
    out = torch.zeros(h.shape[0], spec.hidden_size)
    for head in range(spec.num_heads):
        s1 = q[:, head, 0] @ layer.keys[head, 0, 0].t()
        s2 = q[:, head, 1] @ layer.keys[head, 1, 0].t()
        v1, i1 = s1.topk(spec.topk, dim=-1)
        v2, i2 = s2.topk(spec.topk, dim=-1)
        scores, pos = (v1[:, :, None] + v2[:, None, :]).flatten(1).topk(spec.topk, dim=-1)
        slots = i1.gather(1, pos // spec.topk) * spec.num_keys + i2.gather(1, pos % spec.topk)
        out += (torch.softmax(scores, -1)[..., None] * values[slots]).sum(1)
    return out.view(x.shape)


def torch_batchnorm(layer):
    bn = torch.nn.BatchNorm1d(layer.query_bn.weight.numel())
    with torch.no_grad():
        bn.weight.copy_(layer.query_bn.weight)
        bn.bias.copy_(layer.query_bn.bias)
    return bn


def test_pkm_with_query_batchnorm_and_bias_matches_published_forward():
    torch.manual_seed(0)
    layer = pkm_layer()
    bn = torch_batchnorm(layer)
    micro = [torch.randn(5, 3, 16) for _ in range(3)]
    for x in micro:  # training: batch statistics of each microbatch
        torch.testing.assert_close(layer(x), published_pkm(layer, x, bn), atol=1e-5, rtol=0)
    assert len(layer.query_bn.pending) == 3
    sync_running_stats([layer])  # one process: the microbatches in order, as BatchNorm1d did
    torch.testing.assert_close(layer.query_bn.running_mean, bn.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.query_bn.running_var, bn.running_var, atol=1e-6, rtol=0)
    assert not layer.query_bn.pending
    layer.eval()
    bn.eval()
    x = torch.randn(4, 2, 16)
    torch.testing.assert_close(layer(x), published_pkm(layer, x, bn), atol=1e-5, rtol=0)
    published, norm = layer(x), layer.query_bn
    layer.query_bn = None  # on the same weights, without the BatchNorm the output moves
    assert (layer(x) - published).abs().max() > 1e-2
    layer.query_bn = norm


def test_bias_trains_without_batchnorm_and_is_frozen_with_it():
    """BatchNorm cancels a constant shift of its input: with it the query bias is not trained and
    the input LayerNorm has no bias (their gradients would be rounding noise)."""
    published = pkm_layer()
    assert not published.query.bias.requires_grad and published.norm.bias is None
    spec = published.spec
    plain = MemoryLayer(type(spec)(**dict(vars(spec), query_batchnorm=False)))
    assert plain.query.bias.requires_grad and plain.norm.bias is not None and plain.query_bn is None
    plain(torch.randn(4, 2, 16)).square().sum().backward()
    assert plain.query.bias.grad.abs().max() > 1e-4


def test_query_batchnorm_statistics_are_per_microbatch():
    """The normalisation uses only the current microbatch, whatever ran before it."""
    norm = QueryBatchNorm(4)
    a, b = torch.randn(6, 4), torch.randn(6, 4) * 3 + 1
    alone = norm(b)
    norm(a)
    torch.testing.assert_close(norm(b), alone)
    ref = (b - b.mean(0)) / torch.sqrt(b.var(0, unbiased=False) + 1e-5)
    torch.testing.assert_close(alone, ref, atol=1e-5, rtol=0)


EVAL = ["train.eval_iters=1", "train.eval_interval=3", "data.split=80,20,0"]
PP = ["model.num_layers=4", "memory.placement='3:4'"]


REFERENCES = {"one_stage": ["memory.placement='1:2'"], "two_stages": PP}
LAYOUTS = {  # name: (overrides, the reference's name)
    "dp2": (REFERENCES["one_stage"], "one_stage"),
    "tp2": (REFERENCES["one_stage"] + ["parallel.tensor_model_parallel_size=2"], "one_stage"),
    "pp2": (PP + ["parallel.pipeline_model_parallel_size=2"], "two_stages"),
}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The references in this process, the layouts in one launch of 2 processes."""
    base = tiny_overrides(cache_dir) + PKM + PUBLISHED + EVAL
    cases = {name: (base + extra, 1) for name, extra in REFERENCES.items()}
    cases.update({layout: (base + extra, 2) for layout, (extra, _) in LAYOUTS.items()})
    return train_cases(tmp_path_factory, "pkm_layouts", cases)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pkm_query_layout_matches_single_process(layout, runs):
    """Global batch 4 of microbatches of 2: one process runs two microbatches, DP=2 one per
    rank; TP=2 ranks share theirs; PP=2 holds the memory layer on the second stage. With the
    BatchNorm the query bias stays frozen at zero."""
    ref, got = runs[LAYOUTS[layout][1]], runs[layout]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert got["val"][-1] == pytest.approx(ref["val"][-1], abs=1e-5)
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["params"]["memory.0.query.bias"].abs().max() == 0
    assert ref["grads"]["memory.0.query_bn.weight"].abs().max() > 0
    expected = ref["running_stats"][0]
    assert sorted(expected) == ["memory.0.query_bn.running_mean", "memory.0.query_bn.running_var"]
    assert (expected["memory.0.query_bn.running_mean"].abs() > 0).all()  # moved from the init
    holders = [stats for stats in got["running_stats"] if stats]
    assert len(holders) == (1 if layout == "pp2" else 2)
    for stats in holders:
        for name, value in expected.items():
            torch.testing.assert_close(stats[name], value, atol=1e-6, rtol=0, msg=name)
