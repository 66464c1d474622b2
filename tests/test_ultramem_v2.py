"""UltraMemV2 layer (rmt.memory.layer_v2) == the authors' layer on identical weights.

The reference below is a transcription of the forward of ``UltraMemLayerV2`` in the authors'
``olmo/ultramem_layer_v2.py`` (github.com/ZihaoHuang-notabot/Ultra-Sparse-Memory-Network,
commit 780afd0 "support ultramemv2"): ``forward``, ``TuckerDecomposedQueryKeyRetrieval`` with
``ParallelKeyQueryInnerProduct``, and ``ImplicitValueExpansion`` with the semantics of its fused
kernels (``FusedLookup``: per virtual block and core column, ``XperfGlu``: the pre-value dot
product), for ``mem_q_for_each_tucker_rank=True`` and ``mem_value_expand_time=1`` (their
configs'), with their RMS query/key norms (``layer_norm_type: rms``). Their values live in one
table shared by all memory layers, layer ``l`` reading rows ``(slot + l N) mod (L N)``; with
``mem_share_ratio = 1/L`` (their run_ultramem_v2.sh) that is a table per layer, which the
reference checks by building the global table around rmt's.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from rmt.memory.layer_v2 import UltraMemV2Layer
from rmt.memory.retrieval import rank1_selector
from rmt.models.init import std_of

from conftest import memory_spec


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def authors_forward(hidden, w, knn, value_num, all_value_num, offset, use_glu_act, eps):
    """The authors' UltraMemLayerV2 forward, their tensor layouts (see the module docstring)."""
    bs = hidden.shape[0]
    head, _, n_keys, kdim, rank = w["keys"].shape
    query = (hidden @ w["query_proj"].T).view(bs, 2, rank, kdim)
    query = _rms(query, w["query_norm"], eps).view(bs, 2, rank * kdim)
    keys = _rms(w["keys"].transpose(3, 4), w["keys_norm"], eps).transpose(3, 4)
    # TuckerDecomposedQueryKeyRetrieval; ParallelKeyQueryInnerProduct with nhead_share_query = 2
    half = query.shape[-1] // 2
    refine1, refine2 = [], []
    for key_idx in range(rank):
        k = keys[..., key_idx]
        s1 = torch.stack([query[:, i // 2, :half] @ k[i, 0].T for i in range(head)], 1)
        s2 = torch.stack([query[:, i // 2, half:] @ k[i, 1].T for i in range(head)], 1)
        refine1.append(s1)
        refine2.append(s2)
    refine1, refine2 = torch.stack(refine1, -1), torch.stack(refine2, -1)  # [bs, head, n, rank]
    scores1 = (refine1 * w["tucker_core_u"]).sum(-1)
    scores2 = (refine2 * w["tucker_core_v"]).sum(-1)
    _, indices1 = scores1.topk(knn, dim=2)
    _, indices2 = scores2.topk(knn, dim=2)
    chosen1 = refine1.gather(2, indices1.unsqueeze(-1).expand(-1, -1, -1, rank))
    chosen2 = refine2.gather(2, indices2.unsqueeze(-1).expand(-1, -1, -1, rank))
    score_list = [(chosen1 @ core @ chosen2.transpose(-1, -2)).view(bs, head, -1) for core in w["tucker_core"]]
    all_scores = torch.stack(score_list, -1).sum(-1)
    all_indices = (indices1.view(bs, head, knn, 1) * n_keys + indices2.view(bs, head, 1, knn)).view(bs, head, -1)
    _, best = all_scores.topk(knn, dim=2)
    best_scores = torch.stack([s.gather(2, best) for s in score_list], -1).view(bs, -1, len(score_list))
    best_indice = w["shuffle_index"][all_indices.gather(2, best).view(bs, -1)]
    # ImplicitValueExpansion (fused kernels' semantics)
    groups = w["shuffle_index"].numel() // value_num
    group = best_indice // value_num
    real = (best_indice % value_num + offset) % all_value_num
    if "pre_values" in w:  # pre_vdim > 0
        pre_input = hidden @ w["pre_values_proj"].T
        pre_score = (F.embedding(real, w["pre_values"]) * pre_input.unsqueeze(1)).sum(-1)
        if use_glu_act:
            pre_score = F.gelu(pre_score)
        best_scores = pre_score.unsqueeze(-1) * best_scores
    C = best_scores.shape[-1]
    rows = F.embedding(real, w["values"]).view(bs, real.shape[1], C, -1)
    weighted = (rows * best_scores.unsqueeze(-1)).flatten(2)  # core c scales its column chunk
    output = torch.zeros(bs, groups, weighted.shape[-1], dtype=weighted.dtype)
    output = output.scatter_add(1, group.unsqueeze(-1).expand_as(weighted), weighted)
    output = output.sum(1)  # value_expand_time 1: the virtual blocks summed, one projection
    return output @ w["values_proj"].T


def _layer(dtype, pre_value_dim=6, ive_blocks=4, num_cores=2, topk=None, activation="none", seed=0):
    num_keys = 3
    n = num_keys * math.isqrt(ive_blocks)
    spec = memory_spec(
        type="ultramem_v2",
        hidden_size=12,
        num_heads=1,
        topk=topk or n,
        key_dim=5,
        num_keys=num_keys,
        retrieval="tucker",
        tucker_rank=2,
        num_cores=num_cores,
        ive_blocks=ive_blocks,
        value_dim=8,
        pre_value_dim=pre_value_dim,
        pre_value_activation=activation,
        seed=seed,
    )
    torch.manual_seed(seed)
    layer = UltraMemV2Layer(spec).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)  # away from the constant gains and the 0.02 tables
    return layer


def _authors_weights(layer, layer_id, num_layers, gen):
    """The authors' tensors holding ``layer``'s weights: their query projection has a second
    block of 2 Kd rows, read by heads 2 and 3 only (``i // nhead_share_query``), here random;
    their global tables hold other layers' rows around this layer's window."""
    s = layer.spec
    N, dtype = s.num_values, layer.keys.dtype
    total, u, t = rank1_selector(layer.cores)

    def around(table):
        full = torch.randn(N * num_layers, table.shape[1], generator=gen, dtype=dtype)
        full[layer_id * N : (layer_id + 1) * N] = table
        return full.requires_grad_()

    unused = torch.randn(2 * s.side_dim, s.hidden_size, generator=gen, dtype=dtype)
    n = s.grid
    shuffle = layer.shuffle(torch.arange(n * n)) if layer.shuffle is not None else torch.arange(n * n)
    w = {
        "query_proj": torch.cat([layer.query.weight.detach(), unused]).requires_grad_(),
        "keys": layer.keys.detach().permute(0, 1, 3, 4, 2).clone().requires_grad_(),
        "query_norm": layer.query_norm.weight.detach().clone().requires_grad_(),
        "keys_norm": layer.key_norm.weight.detach().clone().requires_grad_(),
        "tucker_core": [layer.cores[:, c].detach().clone().requires_grad_() for c in range(s.num_cores)],
        "tucker_core_u": u[None, :, None, :],
        "tucker_core_v": t[None, :, None, :],
        "shuffle_index": shuffle,
        "values": around(layer.values.weight.detach()),
        "values_proj": layer.proj.weight.detach().clone().requires_grad_(),
    }
    if s.pre_value_dim:
        w["pre_values"] = around(layer.pre_values.weight.detach())
        w["pre_values_proj"] = layer.pre_proj.weight.detach().clone().requires_grad_()
    return w


CASES = {
    "pre_values_ive_cores": dict(),
    "gelu": dict(activation="gelu"),
    "no_pre_values": dict(pre_value_dim=0),
    "no_ive_one_core": dict(ive_blocks=1, num_cores=1),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_authors_layer_on_identical_weights(case, dtype, tol):
    """Outputs and every gradient equal (fp64 to rounding; fp32 to ~1e-6 of values of order 1-10).
    ``topk`` = the keys per side, so both two-phase selections are exhaustive (see
    test_selection_is_at_least_the_authors' for m smaller)."""
    kw = CASES[case]
    layer = _layer(dtype, **kw)
    s = layer.spec
    gen = torch.Generator().manual_seed(7)
    layer_id, num_layers = 1, 3
    w = _authors_weights(layer, layer_id, num_layers, gen)
    x = torch.randn(5, 2, s.hidden_size, generator=gen, dtype=dtype)
    x_ref = x.reshape(10, -1).clone().requires_grad_()
    x = x.requires_grad_()
    out = layer(x)
    ref = authors_forward(
        x_ref,
        w,
        s.topk,
        s.num_values,
        s.num_values * num_layers,
        layer_id * s.num_values,
        s.pre_value_activation == "gelu",
        s.norm_eps,
    )
    torch.testing.assert_close(out.reshape(10, -1), ref, atol=tol, rtol=tol)
    g = torch.randn(ref.shape, generator=gen, dtype=dtype)
    out.reshape(10, -1).backward(g)
    ref.backward(g)
    N = s.num_values
    window = slice(layer_id * N, (layer_id + 1) * N)
    pairs = {
        "input": (x.grad.reshape(10, -1), x_ref.grad),
        "query": (layer.query.weight.grad, w["query_proj"].grad[: 2 * s.side_dim]),
        "keys": (layer.keys.grad, w["keys"].grad.permute(0, 1, 4, 2, 3)),
        "query_norm": (layer.query_norm.weight.grad, w["query_norm"].grad),
        "key_norm": (layer.key_norm.weight.grad, w["keys_norm"].grad),
        "cores": (layer.cores.grad, torch.stack([c.grad for c in w["tucker_core"]], 1)),
        "values": (layer.values.weight.grad, w["values"].grad[window]),
        "proj": (layer.proj.weight.grad, w["values_proj"].grad),
    }
    if s.pre_value_dim:
        pairs["pre_values"] = (layer.pre_values.weight.grad, w["pre_values"].grad[window])
        pairs["pre_proj"] = (layer.pre_proj.weight.grad, w["pre_values_proj"].grad)
    for name, (got, want) in pairs.items():
        assert want.abs().max() > 0, name
        torch.testing.assert_close(got, want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol, msg=name)
    # the authors' second query block (heads 2, 3) gets no gradient with one head: rmt omits it
    assert w["query_proj"].grad[2 * s.side_dim :].abs().max() == 0
    # the other layers' rows of their global tables get none either
    assert w["values"].grad[: layer_id * N].abs().max() == 0 and w["values"].grad[(layer_id + 1) * N :].abs().max() == 0


def test_selection_is_at_least_the_authors():
    """With m below the keys per side the authors keep the m largest rank-1 objectives per side;
    rmt's selection (rmt.memory.retrieval.tucker_select) keeps the m largest and the m smallest,
    a superset of candidates: its i-th best aggregated score is never below theirs, and is
    higher for some tokens."""
    layer = _layer(torch.float64, topk=3, pre_value_dim=0)
    s = layer.spec
    gen = torch.Generator().manual_seed(3)
    w = _authors_weights(layer, 0, 1, gen)
    h = torch.randn(200, s.hidden_size, generator=gen, dtype=torch.float64)
    _, scores = layer.retrieve(h)
    ours = scores.sum(-1).sort(-1, descending=True).values

    captured = {}
    original = torch.Tensor.topk

    def spy(t, k, dim=-1, *a, **kw):  # the phase-2 top-m over the grid: its values
        result = original(t, k, dim, *a, **kw)
        if t.shape[-1] == s.topk * s.topk:
            captured["best"] = result.values
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", spy)
        authors_forward(h, w, s.topk, s.num_values, s.num_values, 0, False, s.norm_eps)
    theirs = captured["best"].reshape(200, -1)
    assert (ours >= theirs - 1e-12).all()
    assert (ours > theirs + 1e-9).any()


def test_initialization_follows_the_authors():
    spec = memory_spec(
        type="ultramem_v2",
        hidden_size=64,
        num_heads=1,
        topk=4,
        key_dim=16,
        num_keys=8,
        tucker_rank=2,
        num_cores=2,
        ive_blocks=4,
        value_dim=32,
        pre_value_dim=16,
        seed=5,
    )
    layer = UltraMemV2Layer(spec)

    def std(param):  # the std the layer gives the parameter (None: its values as built are kept)
        return std_of(param, "", lambda key, p: pytest.fail("the layer gave the parameter no std of its own"))

    assert std(layer.query.weight) == pytest.approx(16**-0.5)
    assert std(layer.keys) == pytest.approx(16**-0.5)
    assert std(layer.proj.weight) == pytest.approx(32**-0.5)
    assert std(layer.pre_proj.weight) == pytest.approx(64**-0.5)
    assert torch.equal(layer.query_norm.weight, torch.full((16,), 16**-0.4))
    assert torch.equal(layer.key_norm.weight, torch.full((16,), 16**-0.4))
    assert std(layer.cores) is None and 0 <= layer.cores.min() and layer.cores.max() <= 1
    assert torch.equal(layer.cores, UltraMemV2Layer(spec).cores)  # drawn from the layer's seed
    for table in (layer.values.weight, layer.pre_values.weight):
        assert table.shape[0] == 64 and abs(table.std().item() - 0.02) < 0.002
    assert not torch.equal(layer.values.weight[:, :16], layer.pre_values.weight)  # own streams


# -- in the model: every block, beside the FFN -------------------------------------------------

V2 = [
    "memory.type=ultramem_v2",
    "memory.num_heads=1",
    "memory.topk=4",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.value_dim=8",
    "memory.pre_value_dim=4",
    "model.vocab_size=64",
    "model.seq_length=8",
    "model.num_layers=2",
]
ARCHS = {
    "transformer": ["model.hidden_size=16", "model.num_attention_heads=2"],
    "rmt": [
        "model.arch=rmt",
        "model.position=alibi",
        "model.dk=4",
        "model.dv=4",
        "model.rank=2",
        "model.ffn_hidden_size=16",
    ],
}


@pytest.fixture(scope="module")
def single_process():
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate

    parallel.initialize(validate(load_config(None, V2 + ARCHS["transformer"]), 1))
    yield
    parallel.destroy()


def _build(arch, *overrides):
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.models.build import build

    torch.manual_seed(0)
    return build(validate(load_config(None, V2 + ARCHS[arch] + list(overrides)), 1))[0]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_memory_reads_the_ffn_input_and_adds_to_the_block_output(single_process, arch):
    """Layer l's output = the dense block's output + memory_l(the block's normed FFN input), the
    authors' ``x = block(x); x = x + mem(block.ffn_input_after_norm)``: against the model without
    memory on the same weights, layer by layer."""
    model = _build(arch)
    dense = _build(arch, "memory.type=none")
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("memory.")})
    layers, _ = model.memory_hook_layers() if arch == "rmt" else (model.decoder.layers, 0)
    dense_layers, _ = dense.memory_hook_layers() if arch == "rmt" else (dense.decoder.layers, 0)
    assert len(model.memory) == 2
    seen = {}

    def keep(name):
        def hook(module, args, output):
            seen[name] = args[0] if name.startswith("in") else output[0] if isinstance(output, tuple) else output

        return hook

    for k in (0, 1):
        model.memory[k].register_forward_hook(keep(f"mem{k}"))
        model.memory[k].register_forward_pre_hook(lambda m, args, k=k: seen.__setitem__(f"in{k}", args[0]))
        layers[k].register_forward_hook(keep(f"out{k}"))
        norm = dense_layers[k].pre_mlp_layernorm if arch == "transformer" else dense_layers[k].ffn_input
        norm.register_forward_hook(keep(f"ffn{k}"))
        dense_layers[k].register_forward_hook(keep(f"dense{k}"))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8)[None].expand(2, -1)
    model(tokens, positions, None)
    first = dict(seen)
    dense(tokens, positions, None)
    ffn = seen["ffn0"] if arch == "transformer" else dense_layers[0].ff_norm(seen["ffn0"])
    torch.testing.assert_close(first["in0"], ffn.flatten(2))  # the first layer's inputs agree
    if arch == "transformer":  # normed: mean square var / (var + eps) ~ 0.97 a token (unit gain at
        # init, the residual's variance ~ 0.02^2 against eps 1e-5), where the residual's is ~4e-4
        assert first["in0"].pow(2).mean(-1).min() > 0.9
    torch.testing.assert_close(first["out0"], seen["dense0"] + first["mem0"].view(seen["dense0"].shape))
    assert first["mem0"].abs().max() > 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_async_stream_gives_the_synchronous_result(single_process, arch):
    """``memory.async_stream``: each layer's memory runs from its FFN input alongside the FFN
    (the RMT's FFN norm of it on the dense side); the Eq. 12 loss (the trainer's pop_aux_loss in
    the synchronous mode) backpropagates on the stream."""
    from rmt.memory import pop_aux_loss

    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(8)[None].expand(2, -1)
    outs, grads = [], []
    for stream in ("false", "true"):
        model = _build(arch, f"memory.async_stream={stream}")
        with torch.no_grad():  # the RMT's unembedding starts at zero: drawn, so gradients flow
            gen = torch.Generator().manual_seed(3)
            for p in model.parameters():
                if not p.any():
                    p.normal_(generator=gen)
        out = model(tokens, positions, None)
        (out.float().square().mean() + pop_aux_loss(model)).backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    assert sorted(grads[1]) == sorted(grads[0]) and "memory.1.pre_values.weight" in grads[0]
    norm = "decoder.layers.1.pre_mlp_layernorm.weight" if arch == "transformer" else "layers.1.ff_norm.weight"
    for name in (norm, "memory.1.pre_values.weight", "memory.1.query.weight"):
        assert grads[0][name].abs().max() > 0, name
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-7, rtol=1e-6, msg=name)


def test_placement_lists_layers(single_process):
    model = _build("transformer", "model.num_layers=3", "memory.placement=1/3")
    assert sorted(model.memory._modules) == ["0", "1"]
    assert model.memory_wiring.placement == {0: (1, 1), 1: (3, 3)}


@pytest.mark.parametrize(
    "override,message",
    [
        ("memory.placement='1:2'", "must be a layer 'i' or a range 'i-j'"),
        ("memory.topk=9", r"memory.topk \(9\) exceeds the 8 keys per side"),
        ("memory.num_cores=3", r"the value dim \(8\) must be divisible by memory.num_cores \(3\)"),
        ("memory.softmax=true", "has RMS-normed queries without bias and no softmax"),
        ("memory.pre_value_activation=relu", "memory.pre_value_activation must be one of 'none', 'gelu', got 'relu'"),
        ("memory.ive_blocks=2", "must be a perfect square"),
    ],
)
def test_config_errors(override, message):
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, V2 + ARCHS["transformer"] + ["memory.ive_blocks=4", override]), 1)


def test_v2_keys_rejected_for_other_types():
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import ConfigError

    with pytest.raises(ConfigError, match="apply to memory.type 'ultramem_v2', not 'ultramem'"):
        validate(load_config(None, ["memory.type=ultramem", "memory.placement='1:2'", "memory.pre_value_dim=4"]), 1)


def test_plan_memory_counts_both_tables_and_the_keys(single_process):
    """``rmt-plan memory`` of an UltraMemV2 config: per layer, the value and pre-value tables'
    bytes and the keys' bytes of the built model."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.memory import components, plan_from_config

    config = validate(load_config(None, V2 + ARCHS["transformer"] + ["memory.ive_blocks=4"]), 1)
    model = _build("transformer", "memory.ive_blocks=4")
    plan = plan_from_config(config, group_size=1, layers=2, microbatches=1)
    parts = components(plan)
    layer = model.memory[0]
    tables = sum(t.weight.numel() * t.weight.element_size() for t in (layer.values, layer.pre_values))
    assert parts["table"] == tables
    assert parts["keys"] == layer.keys.numel() * 4


def test_plan_model_gives_the_memory_over_ffn_ratio():
    """``rmt-plan model``: UltraMemV2's per-layer forward FLOPs over the FFN's (two matmuls,
    4 x 128 x 512 per token in configs/ultramem_v2_tiny.yaml; 4 x (4 x 32) x 512 in the RMT twin)."""
    from rmt.config import load_config
    from rmt.planner.flops import plan_model

    for name, ffn in (("ultramem_v2_tiny", 4 * 128 * 512), ("ultramem_v2_rmt_tiny", 4 * 4 * 32 * 512)):
        mem = plan_model(load_config(f"configs/{name}.yaml", ["model.vocab_size=64"]))["memory"]
        assert mem["placement"] == "ffn" and [layer["placement"] for layer in mem["layers"]] == ["1", "2"]
        assert mem["memory_over_ffn_flops"] == pytest.approx(mem["layers"][0]["flops_per_token"] / ffn)
