"""Memory layers in the megatron transformer: config validation, skip-placement wiring, aux
losses, the value learning-rate schedule and slot statistics (the MoE baseline: test_moe.py)."""

import re
import socket

import pytest
import torch

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.memory import pop_aux_loss, pop_memory_stats, value_lr_multiplier
from rmt.memory.layer import MemoryLayer
from rmt.memory.retrieval import tucker_aux_loss


def _cfg(*overrides):
    base = [
        "model.num_layers=3",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.seq_length=8",
        "model.vocab_size=64",
        "memory.type=ultramem",
        "memory.placement='1:3/2:2'",
        "memory.key_dim=8",
        "memory.num_keys=4",
        "memory.topk=3",
        "memory.init_samples=2",
        "train.steps=10",
        "train.warmup_steps=0",
    ]
    return load_config(None, base + list(overrides))


@pytest.mark.parametrize(
    "override,message",
    [
        ("memory.placement='3:2'", "ends (layer 2) before it starts (layer 3)"),
        ("memory.placement='1:4'", "within layers 1..model.num_layers (3)"),
        ("memory.placement='0:1'", "within layers 1..model.num_layers (3)"),
        ("memory.placement=a:b", "must have the form 'i:j'"),
        ("memory.placement=3:2", "YAML reads an unquoted single i:j as a base-60 number"),
        ("memory.topk=17", "exceeds the number of memory slots (16)"),
        ("memory.topk=9", "exceeds the 8 keys per side"),
        ("memory.ive_blocks=2", "must be a perfect square"),
        ("memory.value_init_std=0", "memory.value_init_std must be a finite number > 0 or null, got 0.0"),
        ("memory.type=lstm", "memory.type must be one of 'none', 'ultramem', 'ultramem_v2', 'pkm', 'moe', got 'lstm'"),
        ("memory.retrieval=product", "num_cores > 1 (multi-core scoring) needs memory.retrieval 'tucker'"),
        ("memory.tucker_rank=3", "key_dim (8) must be divisible by memory.tucker_rank (3)"),
        (
            "parallel.pipeline_model_parallel_size=3",
            "memory.placement '1:3' crosses the pipeline stage boundary after layer 1; with 3 stages of 1 layers "
            "each placement must lie within layers 1, 2 or 3",
        ),
    ],
)
def test_validation_rejects(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(_cfg(override), world_size=3 if "pipeline" in override else 1)


def test_validation_pkm_and_moe():
    with pytest.raises(ConfigError, match=r"topk \(5\) exceeds memory.num_keys \(4\)"):
        validate(_cfg("memory.type=pkm", "memory.topk=5"), world_size=1)
    with pytest.raises(ConfigError, match=r"moe_topk \(3\) exceeds memory.num_experts \(2\)"):
        validate(_cfg("memory.type=moe", "memory.num_experts=2", "memory.moe_topk=3"), world_size=1)
    validate(_cfg(), world_size=1)
    validate(_cfg("memory.type=pkm"), world_size=1)


@pytest.fixture(scope="module")
def megatron():
    import os

    from rmt.parallel import destroy, initialize

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    os.environ.update(MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0")
    cfg = validate(_cfg(), world_size=1)
    initialize(cfg)
    yield
    destroy()
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _device():
    """Where the trainer would put the model: the GPU where there is one (build() leaves
    megatron's layers there and the rest on the CPU until the model is moved)."""
    from rmt.parallel import compat

    return compat.device()


def _model(cfg):
    from rmt.models.build import build

    (model,) = build(cfg)
    return model.to(_device())


def _inputs(cfg, b=2):
    s = cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    return tuple(x.to(_device()) for x in (tokens, pos, mask))


@pytest.mark.parametrize("kind", ["ultramem", "pkm", "moe"])
def test_skip_placement_wiring(megatron, kind):
    cfg = validate(_cfg(f"memory.type={kind}"), world_size=1)
    model = _model(cfg)
    assert len(model.memory) == 2
    tokens, pos, mask = _inputs(cfg)
    logits = model(tokens, pos, mask)
    # Manual run of the same blocks: memory 0 reads after layer 1 and adds after layer 3,
    # memory 1 reads after layer 2 and adds after layer 2.
    for h in model.memory_wiring.handles:
        h.remove()
    x = model.embedding(input_ids=tokens, position_ids=pos)
    layers = model.decoder.layers
    h1 = layers[0](x, attention_mask=mask)[0]
    h2 = layers[1](h1, attention_mask=mask)[0]
    h2 = h2 + model.memory[1](h2)
    h3 = layers[2](h2, attention_mask=mask)[0] + model.memory[0](h1)
    expected = model.output_layer(model.decoder.final_layernorm(h3))[0].transpose(0, 1)
    torch.testing.assert_close(logits, expected)
    aux = pop_aux_loss(model)
    if kind == "ultramem":
        assert aux is not None and aux.requires_grad
    else:  # PKM has none; megatron's MoE attaches its balance loss to the routing weights
        assert aux is None
    if kind == "ultramem":
        want = sum(tucker_aux_loss(m.cores, 0.001, 0.15) for m in model.memory)
        torch.testing.assert_close(aux, want)
    assert pop_aux_loss(model) is None
    logits.sum().backward()
    for name, p in model.memory.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_memory_parameters_in_sharded_state_dict_and_initialised(megatron):
    from rmt.models.build import build
    from rmt.parallel.sharding import shards

    cfg = validate(_cfg(), world_size=1)
    (a,) = build(cfg)
    (b,) = build(cfg)
    keys = {s.key for s in shards([a]) if ".memory." in s.key or s.key.startswith("memory.")}
    assert "memory.0.values.weight" in keys and "memory.1.cores" in keys
    values = a.memory[0].values.weight
    assert values.std().item() == pytest.approx(a.memory[0].spec.value_std, rel=0.2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    # memory.value_init_std scales the same draw (the counter stream of the table's seed)
    (c,) = build(validate(_cfg("memory.value_init_std=0.02"), world_size=1))
    torch.testing.assert_close(c.memory[0].values.weight, values * (0.02 / a.memory[0].spec.value_std))


def test_value_lr_schedule(megatron):
    from rmt.models.build import build
    from rmt.training.ddp import wrap_chunks
    from rmt.training.optimizer import build_optimizer, build_scheduler

    assert [value_lr_multiplier(s, 100, 10.0) for s in (0, 50, 100, 150)] == [10.0, 5.5, 1.0, 1.0]
    cfg = validate(_cfg("train.lr_decay_style=constant", "train.lr=0.001"), world_size=1)
    chunks = wrap_chunks(build(cfg), cfg)
    opt = build_optimizer(chunks, cfg)
    sched = build_scheduler(opt, cfg)
    groups = [g for g in opt.param_groups if "value_lr_mult" in g]
    assert len(groups) == 1 and len(groups[0]["params"]) == 2 and groups[0]["weight_decay"] == 0.0
    for step in range(11):
        base = [g["lr"] for g in opt.param_groups if "value_lr_mult" not in g][0]
        assert base == pytest.approx(0.001)
        assert groups[0]["lr"] == pytest.approx(0.001 * (10 - 9 * step / 10))
        sched.step(1)


def test_pop_memory_stats_names(megatron):
    cfg = validate(_cfg(), world_size=1)
    model = _model(cfg)
    model.train()
    model(*_inputs(cfg))
    stats = pop_memory_stats([model])
    assert sorted(stats) == sorted(
        f"memory/layer{k}/{n}"
        for k in (0, 1)
        for n in ("slot_hit_fraction", "top1_score_mean", "top1_score_max", "topm_score_mean")
    )
    assert 0 < stats["memory/layer0/slot_hit_fraction"] <= 1
    assert isinstance(model.memory[0], MemoryLayer)


@pytest.mark.parametrize(
    "name",
    [
        "ultramem_tiny",
        "pkm_tiny",
        "moe_tiny",
        "ultramem_151m_x12",
        "ultramem_680m_x12",
        "ultramem_1.6b_x12",
        "pkm_151m_x12",
        "moe_151m_2in32",
        "moe_mlp_tiny",
        "ultramem_v2_tiny",
        "ultramem_v2_rmt_tiny",
        "ultramem_v2_227m",
        "ultramem_v2_olmoe",
    ],
)
def test_shipped_configs_validate(name):
    cfg = validate(load_config(f"configs/{name}.yaml"), world_size=1)
    assert cfg.memory.type in ("ultramem", "ultramem_v2", "pkm", "moe")


@pytest.mark.parametrize("kind", ["sparse_adam", "rowwise_adagrad"])
def test_sparse_value_optimizer_wiring(megatron, kind):
    """``memory.value_optimizer``: the value tables get sparse gradients and their own optimizer,
    chained after megatron's, with the value LR schedule; everything else is in megatron's."""
    from rmt.models.build import build
    from rmt.ops.sparse_optim import RowWiseAdagrad
    from rmt.training.ddp import wrap_chunks
    from rmt.training.optimizer import build_optimizer, build_scheduler

    cfg = validate(
        _cfg(f"memory.value_optimizer={kind}", "train.lr_decay_style=constant", "train.lr=0.001"), world_size=1
    )
    chunks = wrap_chunks(build(cfg), cfg)
    model = chunks[0].module
    values = [model.memory[k].values.weight for k in (0, 1)]
    opt = build_optimizer(chunks, cfg)
    (rows,) = opt.tables
    assert isinstance(rows, RowWiseAdagrad if kind == "rowwise_adagrad" else torch.optim.SparseAdam)
    assert [p for g in rows.param_groups for p in g["params"]] == values
    dense = {id(p) for g in opt.dense.param_groups for p in g["params"]}
    assert dense == {id(p) for p in model.parameters()} - {id(p) for p in values}
    build_scheduler(opt, cfg).step(1)
    assert rows.param_groups[0]["lr"] == pytest.approx(0.001 * 9.1)
    table = model.memory[0].values
    on = table.weight.device
    table.lookup_reduce(
        torch.tensor([[0, 3], [3, 5]], device=on), torch.ones(2, 2, 1, device=on), None, 1
    ).sum().backward()
    assert table.weight.grad.is_sparse
    assert table.weight.grad.coalesce().indices().tolist() == [[0, 3, 5]]


@pytest.mark.parametrize("value_optimizer", ["adamw", "sparse_adam", "rowwise_adagrad"])
def test_optimizer_state_made_for_a_resume_is_torchs_own(megatron, value_optimizer):
    """A resume creates the optimizer states to load into before any step; each tensor must have
    the device, dtype and shape that the optimizer's own first step gives it (on a GPU the fused
    AdamW keeps its step count on the device and refuses a CPU one: seen on an H100)."""
    from rmt.models.build import build
    from rmt.training.checkpoint import _ensure_optimizer_state
    from rmt.training.ddp import wrap_chunks
    from rmt.training.dense_state import inner_optimizers
    from rmt.training.optimizer import build_optimizer

    cfg = validate(_cfg(f"memory.value_optimizer={value_optimizer}"), world_size=1)
    made = build_optimizer(wrap_chunks(build(cfg), cfg), cfg)
    _ensure_optimizer_state(made)
    chunks = wrap_chunks(build(cfg), cfg)
    stepped = build_optimizer(chunks, cfg)
    sparse = {chunks[0].module.memory[k].values.weight for k in (0, 1)} if value_optimizer != "adamw" else set()
    for p in sparse:
        p.grad = torch.zeros_like(p).to_sparse(1)
    chunks[0].zero_grad_buffer()  # zero gradients for everything else
    stepped.prepare_grads()
    stepped.step()
    params = [p for o in inner_optimizers(stepped) for g in o.param_groups for p in g["params"]]

    def layout(opt):
        return [
            [(k, t.device, t.dtype, tuple(t.shape)) for k, t in sorted(o.state[p].items()) if torch.is_tensor(t)]
            for o in inner_optimizers(opt)
            for g in o.param_groups
            for p in g["params"]
        ]

    assert len(layout(stepped)) == len(params) and layout(made) == layout(stepped)


@pytest.mark.parametrize("kind", ["ultramem", "moe"])
def test_async_stream_backward_runs_on_the_stream_and_equals_sync(megatron, kind):
    """With ``memory.async_stream`` the memory layers' backward (auxiliary loss included) runs on
    the stream, and every gradient equals the synchronous mode's (placements 1:3 and 2:2: a fork
    and a join on the same layer). On CPU the stream is the worker thread; on a GPU machine the
    model runs there and the backward is issued into the side CUDA stream instead."""
    import threading

    grads, threads = {}, []
    for mode in ("false", "true"):
        cfg = validate(_cfg(f"memory.type={kind}", f"memory.async_stream={mode}"), world_size=1)
        model = _model(cfg)
        if mode == "true":
            first = next(model.memory[0].parameters())
            first.register_hook(lambda g: threads.append(threading.current_thread().name))
        tokens, pos, mask = _inputs(cfg)
        logits = model(tokens, pos, mask)
        aux = pop_aux_loss(model)
        if kind == "moe":  # the balance loss rides on the routing weights, in either mode
            assert aux is None
            logits.sum().backward()
        else:
            assert aux.requires_grad == (mode == "false")
            (logits.sum() + aux).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    stream = model.memory_wiring.stream
    assert stream.busy_backward_s > 0 and threads
    if stream.side is None:
        assert all(t.startswith("rmt-memory") for t in threads)
    assert grads["true"].keys() == grads["false"].keys()
    # On CPU both modes add the same two partial sums at each fork (the dense layers' gradient and
    # the memory layer's input gradient) and every kernel's result is independent of the thread
    # that runs it, so the gradients are equal bit for bit. (Before, the synchronous mode added
    # the memory's input gradient term by term: gradients below the fork differed in the last
    # bit of terms of ~40, and an embedding element that these terms cancel to < 0.1 came out
    # 1.9e-6 apart, beyond any tolerance relative to the element.) On a GPU kernels are picked
    # per stream: an element of ~0.03 was seen 1.5e-6 apart.
    exact = stream.side is None
    for name, g in grads["false"].items():
        torch.testing.assert_close(
            grads["true"][name], g, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, msg=lambda m: f"{name}: {m}"
        )
