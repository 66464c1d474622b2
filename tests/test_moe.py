"""megatron-core's MoE in rmt: routing, experts and the Switch balance loss (value and gradient)
against a hand computation, token dropping at capacity, config validation, expert parallelism
(EP=2 with either dispatcher, EP=2 x TP=2, expert-TP 1, PP=2 x EP=2, skip placements) equal to
the single process, checkpoints resharding across EP sizes, load statistics in the log."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError

from conftest import json_history, rmt_train, tiny_overrides, train_cases

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.seq_length=8",
    "model.vocab_size=64",
    "memory.type=moe",
    "memory.placement='1:2'",
    "memory.num_experts=4",
    "memory.expert_hidden_size=12",
    "train.steps=10",
    "train.warmup_steps=0",
]


@pytest.fixture(scope="module")
def megatron():
    from rmt.parallel import destroy, initialize

    initialize(validate(load_config(None, []), world_size=1))
    yield
    destroy()


def _skip_moe(*extra):
    from rmt.memory.moe import SkipMoE, set_aux_loss_scale
    from rmt.models.megatron_config import transformer_config

    cfg = validate(load_config(None, SMALL + list(extra)), world_size=1)
    torch.manual_seed(0)
    module = SkipMoE(cfg, transformer_config(cfg))
    set_aux_loss_scale(1.0)
    return cfg, module.train()


def _expert(module, e, h):
    mlp = module.moe.experts.local_experts[e]
    return F.gelu(h @ mlp.linear_fc1.weight.t()) @ mlp.linear_fc2.weight.t()


def _switch_loss(logits, k, coeff):
    """Switch Transformer Eq. 4 with k routing slots per token: ``coeff * N * sum_i f_i P_i``."""
    T, N = logits.shape
    counts = torch.zeros(N).index_add_(0, logits.topk(k, -1).indices.reshape(-1), torch.ones(T * k))
    return coeff * N * (counts / (T * k) * torch.softmax(logits, -1).mean(0)).sum(), counts


def test_routing_experts_and_balance_loss_equal_hand_computation(megatron):
    cfg, module = _skip_moe()
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))
    out = module(x)
    h = module.norm(x).reshape(-1, 16)
    weight = module.moe.router.weight
    logits = h @ weight.t()
    top, idx = logits.topk(2, dim=-1)
    gate = torch.softmax(top, -1)  # softmax over the k chosen logits (Mixtral)
    want = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(2):
            want[t] += gate[t, j] * _expert(module, int(idx[t, j]), h[t : t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, 16), want, rtol=1e-5, atol=1e-6)

    aux, counts = _switch_loss(logits.detach(), 2, cfg.memory.balance_loss_weight)
    stats = module.moe.pop_stats()
    assert stats["load_balancing_loss"] == pytest.approx(float(aux) / cfg.memory.balance_loss_weight, rel=1e-5)
    assert stats["max_expert_load"] == pytest.approx(float(counts.max()) * 4 / float(counts.sum()))

    # The balance loss enters backward through the routing weights at the loss scale (1 here):
    # with a zero main loss the router's gradient is the loss's own.
    module.zero_grad()
    (module(x) * 0).sum().backward()
    w = weight.detach().clone().requires_grad_()
    _switch_loss(h.detach() @ w.t(), 2, cfg.memory.balance_loss_weight)[0].backward()
    torch.testing.assert_close(weight.grad, w.grad, rtol=1e-5, atol=1e-9)


def test_capacity_drops_tokens_beyond_each_experts_capacity(megatron):
    """Capacity ``ceil(T k / N * factor)`` per expert; an expert over it keeps the routing slots
    of largest weight; dropped slots add nothing to the output."""
    factor = 0.5
    cfg, module = _skip_moe(f"memory.moe_expert_capacity_factor={factor}")
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(2))
    out = module(x).reshape(-1, 16)
    h = module.norm(x).reshape(-1, 16)
    T = h.shape[0]
    top, idx = (h @ module.moe.router.weight.t()).topk(2, dim=-1)
    gate = torch.softmax(top, -1)
    capacity = math.ceil(T * 2 / 4 * factor)
    want, kept = torch.zeros_like(h), 0
    for e in range(4):
        slots = [(t, j) for t in range(T) for j in range(2) if idx[t, j] == e]
        slots.sort(key=lambda s: -float(gate[s]))
        for t, j in slots[:capacity]:
            want[t] += gate[t, j] * _expert(module, e, h[t : t + 1])[0]
            kept += 1
    assert kept < 2 * T  # some slots were dropped
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert float(module.moe.load.sum()) == kept


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (
            ["parallel.expert_model_parallel_size=2", "memory.type=none"],
            2,
            "parallel.expert_model_parallel_size and expert_tensor_parallel_size split MoE experts; they need memory.type 'moe'",
        ),
        (
            ["parallel.expert_model_parallel_size=3"],
            3,
            "memory.num_experts (4) must be divisible by parallel.expert_model_parallel_size (3)",
        ),
        (
            ["parallel.expert_model_parallel_size=4"],
            2,
            "world size 2 is not divisible by expert tensor x expert model x pipeline parallel size 1 x 4 x 1 = 4",
        ),
        (
            ["parallel.expert_tensor_parallel_size=5"],
            5,
            "the expert hidden size (12) must be divisible by the expert tensor-parallel size (5)",
        ),
        (
            ["memory.moe_placement=mlp", "memory.placement=2-1"],
            1,
            "memory.placement entry '2-1' must be a layer 'i' or a range 'i-j' with i <= j",
        ),
        (
            ["memory.moe_placement=mlp", "memory.placement=1-3"],
            1,
            "memory.placement entry '1-3' must lie within layers 1..model.num_layers (2)",
        ),
        (
            ["memory.moe_placement=mlp", "model.arch=rmt"],
            1,
            "memory.moe_placement 'mlp' replaces the MLP of megatron's transformer layers",
        ),
        (["memory.moe_placement=side"], 1, "memory.moe_placement must be one of 'skip', 'mlp', got 'side'"),
        (
            ["memory.moe_token_dispatcher_type=flex"],
            1,
            "memory.moe_token_dispatcher_type must be one of 'alltoall', 'allgather', got 'flex'",
        ),
        (
            ["memory.moe_expert_capacity_factor=0"],
            1,
            "memory.moe_expert_capacity_factor must be a finite number > 0 or null, got 0.0",
        ),
        (
            ["parallel.tensor_model_parallel_size=2", "model.seq_length=9"],
            2,
            "model.seq_length (9) must be divisible by parallel.tensor_model_parallel_size (2)",
        ),
    ],
)
def test_validation_rejects(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, SMALL + overrides), world_size=world)


def test_mlp_placement_builds_megatron_moe_in_the_listed_layers(megatron):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from rmt.models.build import build

    cfg = validate(
        load_config(None, SMALL + ["model.num_layers=3", "memory.moe_placement=mlp", "memory.placement=1/3"]),
        world_size=1,
    )
    (model,) = build(cfg)
    kinds = [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers]
    assert kinds == [True, False, True]
    assert model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.shape == (12, 16)
    assert not hasattr(model, "memory")


# ---- distributed == single process -------------------------------------------------------------
MLP = ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=2", "memory.num_experts=4"]
SKIP = ["memory.type=moe", "memory.placement='1:2'", "memory.num_experts=4"]
EP2 = ["parallel.expert_model_parallel_size=2"]
TP2 = ["parallel.tensor_model_parallel_size=2"]
LAYOUTS = {
    "mlp_ep2_alltoall": (MLP, EP2, 2),
    "mlp_ep2_allgather": (MLP, EP2 + ["memory.moe_token_dispatcher_type=allgather"], 2),
    "mlp_ep2_tp2": (MLP, EP2 + TP2, 4),
    "mlp_ep2_tp2_expert_tp1": (MLP, EP2 + TP2 + ["parallel.expert_tensor_parallel_size=1"], 4),
    "mlp_pp2_ep2": (MLP, EP2 + ["parallel.pipeline_model_parallel_size=2"], 4),
    "skip_ep2_tp2": (SKIP, EP2 + TP2, 4),
}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The references in this process, the layouts in one launch per process count."""
    cases = {"mlp": (tiny_overrides(cache_dir) + MLP, 1), "skip": (tiny_overrides(cache_dir) + SKIP, 1)}
    cases.update(
        {name: (tiny_overrides(cache_dir) + moe + parallel, nproc) for name, (moe, parallel, nproc) in LAYOUTS.items()}
    )
    return train_cases(tmp_path_factory, "moe_layouts", cases)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_layout_matches_single_process(layout, runs):
    """Losses, every gradient (experts reassembled at their global indices) and the weights
    after three AdamW steps with gradient clipping, to 1e-5: top-k routing is discontinuous, but
    no router logit of these runs lies within float rounding of a tie."""
    ref, got = runs["mlp" if LAYOUTS[layout][0] is MLP else "skip"], runs[layout]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    assert any(".experts." in key for key in ref["grads"])
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["losses"][2] < ref["losses"][0]


# ---- checkpoints across EP sizes -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("moe,save_ep,load_ep", [(MLP, 2, 1), (SKIP, 1, 2)])
def test_checkpoint_reshards_across_expert_parallel_sizes(moe, save_ep, load_ep, cache_dir, tmp_path):
    """Six steps in one run equal three steps at one EP size, saved, and three more resumed at
    the other (experts and their Adam moments are shards of [num_experts, ...] tensors). The
    logged load-balancing losses (reduced over data-parallel ranks) agree too."""
    common = tiny_overrides(cache_dir, steps=6) + moe + ["train.log_interval=1"]
    whole, first, second = tmp_path / "whole.json", tmp_path / "first.json", tmp_path / "second.json"
    ckpt = tmp_path / "ckpt"
    rmt_train(common + ["--json", str(whole)])

    def ep(size):
        return [f"parallel.expert_model_parallel_size={size}"] if size > 1 else []

    rmt_train(
        common + ep(save_ep) + [f"train.save={ckpt}", "train.exit_interval=3", "--json", str(first)], nproc=save_ep
    )
    rmt_train(common + ep(load_ep) + [f"train.load={ckpt}", "--json", str(second)], nproc=load_ep)
    ref, got = json_history(whole), json_history(first) + json_history(second)
    assert [m["step"] for m in got] == list(range(1, 7))
    assert [m["lm loss"] for m in got] == pytest.approx([m["lm loss"] for m in ref], abs=1e-5)
    stat = "moe/layer2/load_balancing_loss" if moe is MLP else "memory/layer0/load_balancing_loss"
    assert all(stat in m for m in ref)
    assert [m[stat] for m in got] == pytest.approx([m[stat] for m in ref], abs=1e-5)
