"""Activation recomputation (``train.recompute_*``, megatron's semantics and checkpoint function).

Gradients: three trainer steps with and without recomputation, for the transformer (megatron's
TransformerBlock), the RMT, the recurrent transformer and the mixer (rmt.models.recompute), with
an UltraMem layer (synchronous, on the async stream, with the fused value optimizer), a PKM layer,
a skip-placed MoE, MoE MLPs, and UltraMemV2 beside the FFN of every layer (the transformer's
synchronous, on the async stream and with host tables; the RMT's, whose FFN norm the memory
input passes, synchronous and on the async stream), give bit for bit equal losses, gradients and weights. A
recomputed span runs the same kernels on the same inputs with the same RNG state (dropout is
on in one case) and the memory layers are not recomputed, so nothing may round differently.
Each run also counts the spans recomputed in the backward (megatron's ``CheckpointFunction``)
and the memory layers' forwards: recomputation happened as configured and every memory layer
ran once per micro-batch.

Activation memory: the bytes saved for the backward in one training forward (a
``saved_tensors_hooks`` count of distinct storages, parameters excluded), by layer count, so
that the per-layer difference is derived exactly.
"""

import pytest
import torch

from conftest import TINY_RMT, TINY_ULTRAMEM_V2, load_script, tiny_overrides

MEMORY = [
    "memory.type=ultramem",
    "memory.placement='1:3'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
]
RMT = TINY_RMT
ARCHS = {
    "transformer": MEMORY,
    "transformer-async": MEMORY + ["memory.async_stream=true"],
    "transformer-bf16-dropout": MEMORY + ["train.precision=bf16", "model.dropout=0.1"],
    "transformer-pkm": [
        "memory.type=pkm",
        "memory.placement='1:3'",
        "memory.key_dim=8",
        "memory.num_keys=4",
        "memory.topk=3",
    ],
    "transformer-fused": MEMORY + ["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"],
    "transformer-skip-moe": ["memory.type=moe", "memory.placement='1:3'", "memory.num_experts=4"],
    "transformer-moe": ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=2-3", "memory.num_experts=4"],
    "rmt": MEMORY + RMT,
    # UltraMemV2 beside the FFN of all 4 layers: kept from the pre-MLP norm (the RMT's FFN input)
    "transformer-v2": TINY_ULTRAMEM_V2,
    "transformer-v2-async": TINY_ULTRAMEM_V2 + ["memory.async_stream=true"],
    "transformer-v2-host": TINY_ULTRAMEM_V2 + ["memory.table_location=host", "memory.value_optimizer=sparse_adam"],
    "rmt-v2": TINY_ULTRAMEM_V2 + RMT,
    "rmt-v2-async": TINY_ULTRAMEM_V2 + RMT + ["memory.async_stream=true"],
    "recurrent": ["model.arch=recurrent", "model.block_width=8", "model.hidden_size=16"],
    "mixer": ["model.arch=mixer", "model.hidden_size=16"],
}
UNIFORM = ["train.recompute_granularity=full", "train.recompute_method=uniform"]
BLOCK = ["train.recompute_granularity=full", "train.recompute_method=block"]
SELECTIVE = ["train.recompute_granularity=selective"]
# id: (arch, recompute settings, spans recomputed per micro-batch), over 4 layers (memory 1:3, or
# UltraMemV2 in every layer).
CASES = {
    "transformer-uniform2": ("transformer", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "transformer-block3": ("transformer", BLOCK + ["train.recompute_num_layers=3"], 3),
    "transformer-selective": ("transformer", SELECTIVE, 4),
    "transformer-async-uniform1": ("transformer-async", UNIFORM + ["train.recompute_num_layers=1"], 4),
    "transformer-bf16-dropout-uniform2": ("transformer-bf16-dropout", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "transformer-pkm-uniform2": ("transformer-pkm", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "transformer-fused-block3": ("transformer-fused", BLOCK + ["train.recompute_num_layers=3"], 3),
    "transformer-skip-moe-uniform2": ("transformer-skip-moe", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "transformer-moe-uniform2": ("transformer-moe", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "rmt-uniform2": ("rmt", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "rmt-selective": ("rmt", SELECTIVE, 4),
    "transformer-v2-uniform2": ("transformer-v2", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "transformer-v2-block3": ("transformer-v2", BLOCK + ["train.recompute_num_layers=3"], 3),
    "transformer-v2-async-uniform1": ("transformer-v2-async", UNIFORM + ["train.recompute_num_layers=1"], 4),
    "transformer-v2-async-block3": ("transformer-v2-async", BLOCK + ["train.recompute_num_layers=3"], 3),
    "transformer-v2-host-uniform2": ("transformer-v2-host", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "rmt-v2-uniform2": ("rmt-v2", UNIFORM + ["train.recompute_num_layers=2"], 2),
    "rmt-v2-block3": ("rmt-v2", BLOCK + ["train.recompute_num_layers=3"], 3),
    "rmt-v2-async-uniform1": ("rmt-v2-async", UNIFORM + ["train.recompute_num_layers=1"], 4),
    "recurrent-block1": ("recurrent", BLOCK + ["train.recompute_num_layers=1"], 1),
    # tau runs 5 times per layer on 32 tokens in blocks of 8 (eq. 6, three times eq. 7, eq. 8)
    "recurrent-selective": ("recurrent", SELECTIVE, 4 * 5),
    "mixer-uniform2": ("mixer", UNIFORM + ["train.recompute_num_layers=2"], 2),
}
MICROBATCHES = 3 * 2  # 3 steps of global batch 4 in micro-batches of 2


def _record(cache_dir, monkeypatch, overrides):
    """The train_steps record of ``overrides``, with the spans recomputed in the backward and
    the memory layers' forwards counted."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from rmt.memory.layer import MemoryLayer
    from rmt.memory.layer_v2 import UltraMemV2Layer

    counts = {"recomputed": 0, "memory_forwards": 0}
    backward = CheckpointFunction.backward

    def counted_backward(ctx, *grads):
        counts["recomputed"] += 1
        return backward(ctx, *grads)

    def counted(forward):
        def counted_forward(self, *args, **kwargs):
            counts["memory_forwards"] += 1
            return forward(self, *args, **kwargs)

        return counted_forward

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointFunction, "backward", staticmethod(counted_backward))
        for layer in (MemoryLayer, UltraMemV2Layer):
            patch.setattr(layer, "forward", counted(layer.forward))
        record = load_script("tests/dist/train_steps.py").record(
            tiny_overrides(cache_dir) + ["model.num_layers=4"] + list(overrides)
        )
    return record, counts


@pytest.fixture(scope="module")
def references(cache_dir):
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_recompute_gradients_equal_the_run_without(case, cache_dir, references, monkeypatch):
    arch, settings, spans = CASES[case]
    import torch.distributed as dist

    from rmt import parallel

    torch.set_num_threads(1)
    try:
        if arch not in references:
            references[arch] = _record(cache_dir, monkeypatch, ARCHS[arch])
        (ref, ref_counts), (got, counts) = references[arch], _record(cache_dir, monkeypatch, ARCHS[arch] + settings)
    finally:
        if dist.is_initialized():
            parallel.destroy()
    assert ref_counts["recomputed"] == 0
    assert counts["recomputed"] == spans * MICROBATCHES
    memory = any(kind in " ".join(ARCHS[arch]) for kind in ("ultramem", "pkm"))
    layers = len({key.split(".")[1] for key in ref["grads"] if key.startswith("memory.")}) if memory else 0
    assert layers == (4 if "v2" in arch else int(memory))
    assert counts["memory_forwards"] == ref_counts["memory_forwards"] == MICROBATCHES * layers
    assert got["losses"] == ref["losses"]
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for key in ref["grads"]:
        assert torch.equal(got["grads"][key], ref["grads"][key]), key
        assert torch.equal(got["params"][key], ref["params"][key]), key
    if memory:
        assert ref["grads"]["memory.0.keys"].abs().max() > 0
        # a table stepped in its lookups' backward (fused) keeps no gradient: its weights moved
        fused = "memory.fused_value_optimizer=true" in ARCHS[arch]
        assert (ref["grads"]["memory.0.values.weight"].abs().max() > 0) != fused


def saved_bytes(cache_dir, overrides) -> int:
    """Bytes of the distinct storages that one training forward of a micro-batch (2 x 32 tokens)
    saves for its backward, the parameters' own excluded; the backward then runs (consuming the
    memory layers' links)."""
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.models.build import build
    from rmt.models.documents import causal_mask
    from rmt.parallel import compat

    config = validate(load_config(None, tiny_overrides(cache_dir) + ["model.vocab_size=64"] + list(overrides)), 1)
    parallel.initialize(config)
    try:
        device = compat.device()
        model = build(config)[0].to(device).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        s, b = config.model.seq_length, config.train.micro_batch_size
        tokens = torch.randint(0, config.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(0)).to(
            device
        )
        positions = torch.arange(s, device=device)[None].expand(b, s)
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens, positions, causal_mask(s, tokens.device))
        out.float().sum().backward()
        return sum(storages.values())
    finally:
        parallel.destroy()


ACTIVATION_ARCHS = {"transformer": [], "rmt": RMT}


@pytest.mark.parametrize("arch", ACTIVATION_ARCHS)
def test_full_recompute_keeps_one_hidden_state_per_layer(arch, cache_dir):
    """Per layer (the difference between 4 and 2 layers, halved), full recompute with spans of
    one layer keeps exactly the layer's input, ``s x b x width`` fp32 (the mask is one tensor
    for all spans), where the run without recomputation keeps all of the layer's activations;
    selective recompute keeps less than none (with the sdpa kernel, which keeps no ``s x s``
    tensor, little less: the measured numbers are in docs/parallelism.md)."""
    base = ACTIVATION_ARCHS[arch]
    full = UNIFORM + ["train.recompute_num_layers=1"]
    width = 8 * 8 if arch == "rmt" else 32
    per_layer = {}
    for name, settings in (("none", []), ("full", full), ("selective", SELECTIVE)):
        four, two = (saved_bytes(cache_dir, base + settings + [f"model.num_layers={n}"]) for n in (4, 2))
        per_layer[name] = (four - two) / 2
    print(f"{arch}: saved bytes per layer per micro-batch (2 x 32 tokens): {per_layer}")
    assert per_layer["full"] == 32 * 2 * width * 4
    assert per_layer["none"] > per_layer["full"]
    assert per_layer["full"] < per_layer["selective"] < per_layer["none"]


def test_memory_layer_activations_are_kept_under_full_recompute(cache_dir):
    """The memory layer runs once and keeps its activations: what it adds to the saved bytes is
    the same with and without recomputation but for its input, layer 1's output ``s x b x h``
    fp32: without recomputation the dense layers read a copy of it (the branch point's clone,
    :class:`~rmt.memory.stream.ForkMemory`), under recomputation the span boundary keeps the
    tensor itself, which the memory layer's saved input shares."""
    full = UNIFORM + ["train.recompute_num_layers=1"]
    four = ["model.num_layers=4"]
    dense_none, dense_full = (saved_bytes(cache_dir, four + s) for s in ([], full))
    memory_none, memory_full = (saved_bytes(cache_dir, four + MEMORY + s) for s in ([], full))
    print(
        f"memory layer's saved bytes: {memory_none - dense_none} without, {memory_full - dense_full} with full recompute"
    )
    assert memory_none - dense_none > 0
    assert (memory_none - dense_none) - (memory_full - dense_full) == 32 * 2 * 32 * 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.recompute_granularity=partial"],
            "train.recompute_granularity must be one of 'none', 'selective', 'full', got 'partial'",
        ),
        (
            ["train.recompute_granularity=full", "train.recompute_num_layers=1"],
            "train.recompute_granularity 'full' needs train.recompute_method 'uniform' or 'block', got None",
        ),
        (
            ["train.recompute_granularity=full", "train.recompute_method=blocks", "train.recompute_num_layers=1"],
            "train.recompute_method must be one of 'uniform', 'block' or null, got 'blocks'",
        ),
        (
            ["train.recompute_granularity=full", "train.recompute_method=block"],
            "train.recompute_num_layers must lie in [1, 4] (the layers per model chunk) with train.recompute_granularity "
            "'full', got None",
        ),
        (
            [
                "train.recompute_granularity=full",
                "train.recompute_method=block",
                "train.recompute_num_layers=3",
                "parallel.pipeline_model_parallel_size=2",
            ],
            "train.recompute_num_layers must lie in [1, 2] (the layers per model chunk)",
        ),
        (
            ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=3"],
            "train.recompute_num_layers (3) must divide the layers per model chunk (4) with train.recompute_method 'uniform'",
        ),
        (
            ["train.recompute_granularity=selective", "train.recompute_num_layers=2"],
            "train.recompute_num_layers applies to train.recompute_granularity 'full' only (got 'selective'); set it to null",
        ),
        (
            ["train.recompute_method=uniform"],
            "train.recompute_method applies to train.recompute_granularity 'full' only (got 'none'); set it to null",
        ),
        (
            ["train.recompute_granularity=selective", "model.arch=mixer"],
            "train.recompute_granularity 'selective' recomputes core attention, which the mixer does not have; use 'full'",
        ),
    ],
)
def test_recompute_settings_rejected_in_one_sentence(overrides, message):
    from rmt.config import ConfigError, load_config
    from rmt.config_checks import validate

    with pytest.raises(ConfigError) as err:
        validate(
            load_config(None, ["model.num_layers=4"] + overrides),
            world_size=2 if "parallel.pipeline_model_parallel_size=2" in overrides else 1,
        )
    assert str(err.value) == message or str(err.value).startswith(message)
    assert "\n" not in str(err.value)


PLAN_SHAPE = [
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_layers=4",
    "model.seq_length=256",
    "train.micro_batch_size=4",
]


@pytest.mark.parametrize("arch", ["transformer", "rmt"])
def test_activation_bytes_drop_as_rmt_plan_predicts(arch, cache_dir):
    """``rmt-plan model``'s activation bytes per token under each recompute setting against what
    autograd saves (the shape and the 10% of tests/test_flops.py, whose model the recompute
    figures build on): the kept bytes, and the drop from no recomputation."""
    from rmt.config import load_config
    from rmt.planner.flops import plan_model

    base = PLAN_SHAPE + (
        ["model.arch=rmt", "model.dk=16", "model.dv=32", "model.rank=4", "model.position=alibi"]
        if arch == "rmt"
        else []
    )
    tokens = 4 * 256
    measured, planned = {}, {}
    for name, settings in (
        ("none", []),
        ("selective", SELECTIVE),
        ("uniform2", UNIFORM + ["train.recompute_num_layers=2"]),
        ("block1", BLOCK + ["train.recompute_num_layers=1"]),
    ):
        measured[name] = saved_bytes(cache_dir, base + settings) / tokens
        planned[name] = plan_model(load_config(None, base + settings + ["model.vocab_size=64"]))[
            "recomputed_activation_bytes_per_token"
        ]
    print(f"{arch} bytes per token, measured {measured}, planned {planned}")
    for name in measured:
        assert planned[name] == pytest.approx(measured[name], rel=0.10), name
        if name != "none":
            drop, predicted = measured["none"] - measured[name], planned["none"] - planned[name]
            assert predicted == pytest.approx(drop, rel=0.10, abs=0.10 * planned["none"]), name
