"""The memory layers retrieve through the fused op (``memory.retrieval_kernel``: auto takes it on
CPU) with the unfused path's results: every layer (UltraMem's TDQKR with multi-core scoring, IVE,
shared and separate queries; PKM with query bias and BatchNorm; UltraMemV2's per-rank queries
and RMSNorm keys), outputs and every parameter's gradient, decoding, and training in one process.
The parallel layouts (TP, SP, PP, DP, sharded and host tables, the async stream, recomputation)
run the fused op already: their tests compare them with the single process, which runs it."""

import pytest
import torch

import rmt.memory.layer as layer_module
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.memory.layer import MemoryLayer
from rmt.memory.layer_v2 import UltraMemV2Layer

from conftest import TINY_ULTRAMEM, TINY_ULTRAMEM_V2, fast_cases, memory_spec, tiny_overrides, train_runs

BASE = dict(hidden_size=24, num_heads=2, topk=5, key_dim=8, num_keys=6, init_samples=2)
LAYERS = {
    "ultramem": dict(retrieval="tucker", tucker_rank=2, num_cores=2, ive_blocks=4, share_query=False),
    "ultramem_shared_query": dict(retrieval="tucker", tucker_rank=2, num_cores=2, ive_blocks=4, share_query=True),
    "ultramem_rank3_no_norm": dict(
        retrieval="tucker", tucker_rank=3, key_dim=9, num_cores=1, ive_blocks=1, query_key_norm=False
    ),
    "ultramem_product": dict(retrieval="product", num_cores=1, ive_blocks=4),
    "pkm_published": dict(type="pkm", query_batchnorm=True, query_bias=True),  # query bias and BatchNorm
    "ultramem_v2": dict(
        type="ultramem_v2", retrieval="tucker", tucker_rank=2, num_cores=2, ive_blocks=4, value_dim=8, pre_value_dim=4
    ),
}


def _layers(name, dtype):
    """The layer twice on the same weights: the fused retrieval's and the unfused path's."""
    built = []
    for kernel in ("fused", "unfused"):
        torch.manual_seed(0)
        spec = memory_spec(**{**BASE, **LAYERS[name]}, retrieval_kernel=kernel)
        layer = (UltraMemV2Layer if spec.version == 2 else MemoryLayer)(spec).to(dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.05 * torch.randn_like(p))  # away from identity convs and constant gains
        built.append(layer)
    return built


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_fused_equals_unfused(name, dtype, tol):
    """Same addresses; outputs and every gradient to rounding (the backward sums the same terms
    in another order: lookup-reduce's, not the dense product's)."""
    fused, unfused = _layers(name, dtype)
    calls = []
    original = layer_module.fused_retrieval
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_module, "fused_retrieval", lambda *a, **k: calls.append(1) or original(*a, **k))
        x = torch.randn(7, 3, 24, dtype=dtype, generator=torch.Generator().manual_seed(1))
        outs = []
        for layer in (fused, unfused):
            h = layer.query_input(x).reshape(21, 24)
            addr = layer.retrieve(h)[0]
            out = layer(x)
            out.backward(torch.ones_like(out))
            outs.append((addr, out.detach()))
    assert len(calls) == 2  # the fused layer's two retrievals, none of the unfused one's
    assert torch.equal(outs[0][0], outs[1][0])
    scale = max(1.0, outs[1][1].abs().max().item())
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=tol * scale, rtol=tol)
    grads = dict(unfused.named_parameters())
    for key, p in fused.named_parameters():
        want = grads[key].grad
        if want is None:
            assert p.grad is None, key
            continue
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(p.grad, want, atol=tol * scale, rtol=tol, msg=key)


def test_decoding_fused_equals_unfused():
    """Without autograd (cached weight terms), token by token with the query convolution's state."""
    fused, unfused = _layers("ultramem", torch.float64)
    assert fused.spec.conv_kernel > 1
    x = torch.randn(6, 2, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    steps = []
    with torch.no_grad():
        for layer in (fused.eval(), unfused.eval()):
            state = {}
            steps.append(torch.cat([layer(x[t : t + 1], state) for t in range(6)]))
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(steps[0], fused(x), rtol=1e-12, atol=1e-12)


def _config(kernel, precision="fp32"):
    return load_config(
        None,
        [
            "model.hidden_size=32",
            "memory.type=ultramem",
            "memory.placement='1:2'",
            f"memory.retrieval_kernel={kernel}",
            f"train.precision={precision}",
        ],
    )


def test_fused_without_a_backend_for_the_device_is_refused(monkeypatch):
    """``fused`` is accepted where a backend declares the device and precision (the C++ backend on
    a CPU, CUDA and Triton on a GPU); where none does (here the GPU backends narrowed to float32)
    it is refused in one sentence naming each device once, and ``auto`` takes the unfused path."""
    import dataclasses

    from rmt.retrieval_backends import RETRIEVAL_REGISTRY

    validate(_config("fused", "bf16"), 1)
    monkeypatch.setattr("rmt.parallel.compat.cuda_available", lambda: True)
    validate(_config("fused", "bf16"), 1)
    validate(_config("fused", "fp32"), 1)
    for name in ("cuda", "triton"):
        narrowed = dataclasses.replace(RETRIEVAL_REGISTRY[name], dtypes=frozenset({"float32"}))
        monkeypatch.setitem(RETRIEVAL_REGISTRY, name, narrowed)
    validate(_config("fused", "fp32"), 1)
    with pytest.raises(ConfigError) as err:
        validate(_config("fused", "bf16"), 1)
    assert str(err.value) == (
        "memory.retrieval_kernel 'fused' has no backend for cuda tensors in train.precision 'bf16' (the "
        "fused retrieval runs on: cpu bfloat16, float32, float64; cuda float32); use 'auto' (the unfused "
        "path where the fused one has no backend) or 'unfused'"
    )
    validate(_config("auto", "bf16"), 1)


@pytest.mark.parametrize("arch", fast_cases(["ultramem", "ultramem_v2", "pkm"], fast=["ultramem"]))
def test_training_fused_equals_unfused(arch, cache_dir, tmp_path):
    """Three steps in one process: losses, gradients and weights to fp32 rounding (1e-5)."""
    memory = {
        "ultramem": TINY_ULTRAMEM,
        "ultramem_v2": TINY_ULTRAMEM_V2,
        "pkm": ["memory.type=pkm", "memory.placement='1:2'", "memory.key_dim=8", "memory.num_keys=4", "memory.topk=3"],
    }[arch]
    runs = {
        tmp_path / f"{kernel}.pt": tiny_overrides(cache_dir) + memory + [f"memory.retrieval_kernel={kernel}"]
        for kernel in ("fused", "unfused")
    }
    fused, unfused = (train_runs(runs)[path] for path in runs)
    assert fused["losses"] == pytest.approx(unfused["losses"], abs=1e-5)
    for key in unfused["grads"]:
        torch.testing.assert_close(fused["grads"][key], unfused["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(fused["params"][key], unfused["params"][key], atol=1e-5, rtol=0, msg=key)
