"""``model.attention_kernel: sdpa`` (torch's fused attention) and ``megatron_fused`` (megatron's
fused softmax) against megatron-core's ``DotProductAttention`` (``megatron``, the reference): the
same weights give the same outputs and gradients in every architecture built on megatron layers,
with causal and document masks, a single decoding query, dropout, and the validator's and the
builder's sentences."""

import copy
import importlib.util
import warnings

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.attention import SDPAttention
from rmt.models.build import build
from rmt.models.fused_softmax import FUSED_SOFTMAX_EXTENSIONS
from rmt.models.megatron_config import transformer_config

from conftest import LLAMA, run_python

warnings.filterwarnings("ignore")

BASE = [
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_layers=2",
    "model.seq_length=24",
    "model.vocab_size=61",
]
ARCHS = {
    "transformer": ["model.arch=transformer"],
    "transformer_rope": ["model.arch=transformer", "model.position=rope"],
    "recurrent": ["model.arch=recurrent", "model.block_width=8"],
    "transformer_llama": ["model.arch=transformer"] + LLAMA,
    "moe_mlp": [
        "model.arch=transformer",
        "memory.type=moe",
        "memory.moe_placement=mlp",
        "memory.placement=2",
        "memory.num_experts=4",
        "memory.expert_hidden_size=16",
    ],
}
# Both kernels compute the same fp32 sums in different orders (torch's kernel accumulates the
# softmax online, block by block): a few fp32 ulps per element, relative to the largest entry.
RTOL = 1e-5


def config(kernel: str, overrides):
    return validate(load_config(None, BASE + [f"model.attention_kernel={kernel}"] + list(overrides)), 1)


def document_mask(batch: int, s: int) -> torch.Tensor:
    """Per-sample ``[b, 1, s, s]`` masks (True = masked): causal within documents that start at
    different places in each sample."""
    doc = torch.zeros(batch, s, dtype=torch.long)
    for i in range(batch):
        doc[i, 5 + 3 * i :] += 1
        doc[i, 15 + i :] += 1
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    return (causal | (doc[:, :, None] != doc[:, None, :]))[:, None]


def forward_backward(kernel: str, overrides, state, tokens, mask):
    cfg = config(kernel, overrides)
    parallel.initialize(cfg)
    try:
        model = build(cfg)[0].eval()
        if state is not None:
            model.load_state_dict(state)
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        out = model(tokens, positions, mask)
        out.pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.detach(), grads, copy.deepcopy(model.state_dict())
    finally:
        parallel.destroy()


def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=RTOL * b.abs().max().item())


@pytest.mark.parametrize("masks", ["causal", "documents"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kernel", ["sdpa", "megatron_fused"])
def test_each_kernel_equals_megatron_kernel(kernel, arch, masks):
    """fp32: ``megatron_fused`` runs megatron's unfused softmax (its fused kernel takes 16-bit
    scores only), so it equals the reference; ``sdpa`` to rounding."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 61, (3, 24))
    mask = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None] if masks == "causal" else document_mask(3, 24)
    ref, ref_grads, state = forward_backward("megatron", ARCHS[arch], None, tokens, mask)
    out, grads, _ = forward_backward(kernel, ARCHS[arch], state, tokens, mask)
    assert_same(out, ref)
    assert ref_grads.keys() == grads.keys() and len(grads) > 10
    for name in ref_grads:
        assert_same(grads[name], ref_grads[name])


def test_the_kernel_is_in_every_attention_layer():
    for kernel, cls, fusion in (
        ("sdpa", SDPAttention, False),
        ("megatron", DotProductAttention, False),
        ("megatron_fused", DotProductAttention, True),
    ):
        for arch in ARCHS.values():
            cfg = config(kernel, arch)
            parallel.initialize(cfg)
            try:
                cores = [m for m in build(cfg)[0].modules() if isinstance(m, DotProductAttention)]
            finally:
                parallel.destroy()
            assert {type(m) for m in cores} == {cls}
            assert {m.scale_mask_softmax.scaled_masked_softmax_fusion for m in cores} == {fusion}


NO_FUSED_SOFTMAX = pytest.mark.skipif(
    all(importlib.util.find_spec(name) for name in FUSED_SOFTMAX_EXTENSIONS),
    reason="megatron's fused softmax extensions are installed here",
)


@NO_FUSED_SOFTMAX
@pytest.mark.parametrize(
    "kernel, precision", [("megatron_fused", "bf16"), ("megatron_fused", "fp32"), ("megatron", "bf16")]
)
def test_rmt_train_check_refuses_megatron_fused_where_its_extension_is_missing(kernel, precision):
    """Only the fused softmax on 16-bit scores needs the extension."""
    proc = run_python(
        ["-m", "rmt.training.cli", "--check", "--config", "configs/tiny.yaml", "model.arch=transformer"]
        + [f"model.attention_kernel={kernel}", f"train.precision={precision}"],
        check=False,
    )
    if (kernel, precision) != ("megatron_fused", "bf16"):
        assert proc.returncode == 0 and proc.stdout.startswith("rmt-train: config OK"), proc.stderr[-2000:]
        return
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "rmt-train: error: model.attention_kernel 'megatron_fused' under train.precision 'bf16' needs megatron's "
        "fused softmax extension scaled_upper_triang_masked_softmax_cuda (built by Megatron-LM's fused_kernels or "
        "Apex), which is not installed here; use 'megatron' or 'sdpa'"
    )


@NO_FUSED_SOFTMAX
def test_megatron_fused_under_bf16_needs_the_fused_softmax_extension():
    """The extension is a CUDA build (Megatron-LM's fused_kernels or Apex), absent from a CPU
    install: the model is refused at build, not in its first forward."""
    cfg = config("megatron_fused", ARCHS["transformer"] + ["train.precision=bf16"])
    parallel.initialize(cfg)
    try:
        with pytest.raises(
            ConfigError,
            match="^model.attention_kernel 'megatron_fused' under train.precision 'bf16' needs megatron's fused "
            "softmax extension scaled_upper_triang_masked_softmax_cuda \\(built by Megatron-LM's fused_kernels or "
            "Apex\\), which is not installed here; use 'megatron' or 'sdpa'$",
        ):
            build(cfg)
    finally:
        parallel.destroy()


@pytest.fixture
def kernels():
    """Both core attentions of one layer of a 4-head, head-dim-8 config."""
    cfg = config("sdpa", ARCHS["transformer"])
    parallel.initialize(cfg)
    tcfg = transformer_config(cfg)
    yield tuple(
        cls(tcfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for cls in (SDPAttention, DotProductAttention)
    )
    parallel.destroy()


def test_no_mask_means_causal_and_a_single_query_sees_every_key(kernels):
    sdpa, megatron = kernels
    torch.manual_seed(1)
    q, k, v = (torch.randn(7, 2, 4, 8) for _ in range(3))
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None]
    assert_same(sdpa(q, k, v, None), megatron(q, k, v, causal))
    # one decoding query against 7 cached keys: megatron builds no mask for it
    assert_same(sdpa(q[-1:], k, v, None), megatron(q[-1:], k, v, None))
    assert_same(sdpa(q[-1:], k, v, None), sdpa(q, k, v, None)[-1:])


def test_attention_dropout_acts_in_training_only(kernels):
    cfg = config("sdpa", ARCHS["transformer"] + ["model.dropout=0.5"])
    sdpa = SDPAttention(
        transformer_config(cfg), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    torch.manual_seed(2)
    q, k, v = (torch.randn(7, 2, 4, 8) for _ in range(3))
    reference = kernels[1]
    assert_same(sdpa.eval()(q, k, v, None), reference(q, k, v, torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None]))
    dropped = sdpa.train()(q, k, v, None)
    assert (dropped - sdpa.eval()(q, k, v, None)).abs().max() > 0.1


def test_unknown_kernel_is_one_sentence():
    with pytest.raises(
        ConfigError, match="^model.attention_kernel must be one of 'sdpa', 'megatron', 'megatron_fused', got 'flash'$"
    ):
        config("flash", [])
