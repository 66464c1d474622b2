"""megatron-core's distributed optimizer (``train.distributed_optimizer``): training equals the
single process (plain optimizer) under DP = 2 and 4, with TP and PP, for every architecture and
with sharded, sparse and fused memory tables (also on one pipeline stage only); each rank holds 1/DP of the dense optimizer state
(megatron's bucket padding aside); checkpoints reshard between DP sizes and to and from the
plain optimizer with the losses of an uninterrupted run."""

import pytest
import torch

from conftest import TINY_RMT, TINY_ULTRAMEM, tiny_overrides, train_cases, train_runs

pytestmark = pytest.mark.slow

DIST = ["train.distributed_optimizer=true"]
ULTRAMEM = TINY_ULTRAMEM
MODELS = {
    "transformer": [],
    "ultramem_sharded_fused": ULTRAMEM
    + [
        "memory.partition=number",
        "memory.value_optimizer=sparse_adam",
        "memory.fused_value_optimizer=true",
        "memory.async_stream=true",
    ],
    "ultramem_local_adamw": ULTRAMEM,
    # tables on the second of two pipeline stages only
    "ultramem_late": ULTRAMEM + ["model.num_layers=4", "memory.placement='3:4'"],
    "pkm_rowwise": [
        "memory.type=pkm",
        "memory.placement='1:2'",
        "memory.key_dim=8",
        "memory.num_keys=8",
        "memory.topk=4",
        "memory.value_optimizer=rowwise_adagrad",
    ],
    "moe_mlp": ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=1-2", "memory.num_experts=4"],
    "rmt": TINY_RMT,
    "recurrent": ["model.arch=recurrent", "model.block_width=4", "model.seq_length=16"],
    "mixer": ["model.arch=mixer", "model.seq_length=16"],
}
# 2 ranks: every model at DP = 2 (and the overlapped reduce-scatter / all-gather); 4 ranks: the
# layouts
TWO = {f"{name}_dp2": (name, []) for name in MODELS}
TWO["transformer_dp2_overlap"] = (
    "transformer",
    ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true", "train.ema_decay=null"],
)
FOUR = {
    "transformer_dp4": ("transformer", []),
    "transformer_tp2_dp2": ("transformer", ["parallel.tensor_model_parallel_size=2"]),
    "transformer_pp2_dp2": ("transformer", ["parallel.pipeline_model_parallel_size=2"]),
    "ultramem_sharded_fused_tp2_dp2": ("ultramem_sharded_fused", ["parallel.tensor_model_parallel_size=2"]),
    "ultramem_late_pp2_dp2": ("ultramem_late", ["parallel.pipeline_model_parallel_size=2"]),
}


def _common(cache_dir):
    # one sample per micro-batch: 4 micro-batches on one rank, 1 on each of 4
    return tiny_overrides(cache_dir) + ["train.micro_batch_size=1", "train.global_batch_size=4", "train.ema_decay=0.5"]


BF16 = ["train.precision=bf16"]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    common = _common(cache_dir)
    cases = {f"single_{name}": (common + extra, 1) for name, extra in MODELS.items()}
    cases["single_transformer_bf16"] = (common + BF16, 1)
    cases["transformer_bf16_dp2"] = (common + BF16 + DIST, 2)
    cases["transformer_bf16_dp2_plain"] = (common + BF16, 2)
    cases.update({case: (common + MODELS[name] + extra + DIST, 2) for case, (name, extra) in TWO.items()})
    cases.update({case: (common + MODELS[name] + extra + DIST, 4) for case, (name, extra) in FOUR.items()})
    return train_cases(tmp_path_factory, "distributed_optimizer", cases)


@pytest.mark.parametrize("case", sorted(TWO) + sorted(FOUR))
def test_distributed_optimizer_equals_single_process(case, runs):
    """Losses, gradient norms, gradients (the distributed optimizer's ranges summed), weights and
    weight averages equal the plain optimizer's in one process to fp32 rounding: the ranks sum
    the same per-sample gradients in another order (each element's reduction differs by a few
    ulps of the gradient, 1e-5 of these O(1) values bounds it with margin)."""
    name = (TWO.get(case) or FOUR[case])[0]
    ref, got = runs[f"single_{name}"], runs[case]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
        if "train.ema_decay=null" not in (TWO.get(case) or FOUR[case])[1]:
            torch.testing.assert_close(got["averages"][key], ref["averages"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["losses"][2] < ref["losses"][0]


@pytest.mark.parametrize("case,dp", [("transformer_dp2", 2), ("transformer_dp4", 4)])
def test_each_rank_holds_its_share_of_the_optimizer_state(case, dp, runs):
    """Adam's two moments of the dense parameters: every element once over the data-parallel
    ranks of a model-parallel position (so exactly the plain optimizer's total), no rank more
    than its 1/DP of megatron's padded buffer. The padding (each bucket rounded up to a multiple
    of lcm(DP, 128) elements, each parameter's start to a multiple of 64) is the only excess."""
    single = runs["single_transformer"]["optimizer_held"][0]
    held = runs[case]["optimizer_held"]
    assert "main_param" not in single  # fp32: the parameters are the main copies
    assert len(held) == dp
    for name in ("exp_avg", "exp_avg_sq"):
        assert sum(r[name] for r in held) == single[name]
        assert sum(r[name + "_bytes"] for r in held) == single[name + "_bytes"]
    assert single["buffer_numel"] == single["exp_avg"]  # the plain optimizer's buffer is not padded
    for r in held:
        assert r["buffer_numel"] % dp == 0 and r["buffer_numel"] >= r["buffer_numel_unpadded"]
        assert r["exp_avg"] <= r["buffer_numel"] // dp


def test_checkpoints_reshard_across_dp_and_to_and_from_the_plain_optimizer(cache_dir, tmp_path):
    """Saved at DP = 4 with the distributed optimizer after 2 of 4 steps, resumed at DP = 2 (with
    and without it) and at DP = 1; saved at DP = 2 without it, resumed at DP = 4 with it: every
    continuation's losses are the uninterrupted run's, to fp32 rounding."""
    common = _common(cache_dir) + ["train.steps=4", "train.ema_decay=null"]
    dist4, plain2 = tmp_path / "dist4", tmp_path / "plain2"
    first = common + ["train.exit_interval=2"]
    save4 = train_runs({tmp_path / "save4.pt": first + DIST + [f"train.save={dist4}"]}, nproc=4)
    two = train_runs(
        {
            tmp_path / "save2.pt": first + [f"train.save={plain2}"],
            tmp_path / "dist2.pt": common + DIST + [f"train.load={dist4}", f"train.save={tmp_path / 'a'}"],
            tmp_path / "plain2.pt": common + [f"train.load={dist4}", f"train.save={tmp_path / 'b'}"],
        },
        nproc=2,
    )
    one = train_runs(
        {
            tmp_path / "whole.pt": common,
            tmp_path / "plain1.pt": common + [f"train.load={dist4}", f"train.save={tmp_path / 'c'}"],
        }
    )
    back = train_runs(
        {tmp_path / "dist4.pt": common + DIST + [f"train.load={plain2}", f"train.save={tmp_path / 'd'}"]}, nproc=4
    )
    whole = one[tmp_path / "whole.pt"]["losses"]
    assert save4[tmp_path / "save4.pt"]["losses"] == pytest.approx(whole[:2], abs=1e-5)
    assert two[tmp_path / "save2.pt"]["losses"] == pytest.approx(whole[:2], abs=1e-5)
    for resumed in (
        two[tmp_path / "dist2.pt"],
        two[tmp_path / "plain2.pt"],
        one[tmp_path / "plain1.pt"],
        back[tmp_path / "dist4.pt"],
    ):
        assert resumed["losses"] == pytest.approx(whole[2:], abs=1e-5)


def test_bf16_bytes_per_parameter_as_planned(runs):
    """``train.precision: bf16`` keeps bf16 parameters, fp32 gradients and an fp32 main copy with
    fp32 moments: 18 bytes per parameter with the plain optimizer, 6 + 12 / DP with the
    distributed one (:func:`rmt.planner.dense.dense_bytes_per_param`), the gradient buffer padded
    as megatron pads it."""
    from rmt.planner.dense import dense_bytes_per_param

    plain = runs["single_transformer_bf16"]["optimizer_held"][0]
    n = plain["exp_avg"]
    per = dense_bytes_per_param("bf16", False, 1)
    assert plain["buffer_numel"] == n and sum(per.values()) == 18
    for kind in ("param", "grad", "main_param", "exp_avg", "exp_avg_sq"):
        assert plain[f"{kind}_bytes"] == per[kind] * n, kind
    held = runs["transformer_bf16_dp2"]["optimizer_held"]
    per = dense_bytes_per_param("bf16", True, 2)
    assert sum(per.values()) == 6 + 12 / 2
    for kind in ("main_param", "exp_avg", "exp_avg_sq"):  # the shards: exactly the whole over the ranks
        assert sum(r[f"{kind}_bytes"] for r in held) == 2 * per[kind] * n, kind
    for r in held:
        assert r["param_bytes"] == per["param"] * n
        assert r["grad_bytes"] == per["grad"] * r["buffer_numel"]  # padded
        assert r["main_param_bytes"] <= per["main_param"] * r["buffer_numel"]


def test_bf16_distributed_equals_the_plain_optimizer(runs):
    """bf16 parameters at DP = 2, distributed against plain optimizer: the same per-rank
    gradients summed over two ranks (a sum of two is the same in either order), the same
    element-wise AdamW on the fp32 main copies, whole or in shards; only the clipping factor
    differs, by the fp32 rounding of the norm summed over shards in another order. So the main
    copies agree to a few fp32 ulps and a bf16 weight, their rounding, by at most one bf16 ulp
    (where the two straddle a rounding boundary); a loss by at most the sum of |dL/dw| x ulp(w),
    under 1e-3 here (gradient norms below 2, weights below 0.2, ulp 2^-8 relative)."""
    ref, got = runs["transformer_bf16_dp2_plain"], runs["transformer_bf16_dp2"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-3)
    for key, value in ref["params"].items():
        assert torch.equal(value, value.bfloat16().float()), key  # bf16 weights (gathered as fp32)
        ulp = torch.exp2(torch.floor(torch.log2(value.float().abs().clamp_min(2.0**-126))) - 7)
        assert bool(((got["params"][key].float() - value.float()).abs() <= ulp).all()), key
