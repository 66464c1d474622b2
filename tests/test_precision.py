"""bf16 (autocast) training runs on CPU and tracks fp32 closely, for the transformer, the RMT and
megatron's MoE (router in fp32), and the UltraMem, UltraMemV2 and PKM memory layers (their scores
come out of autocast in bf16 and meet a float32 value table)."""

import pytest

from conftest import tiny_overrides, train_steps

# The RMT's logits start uniform and move slowly at the tiny default rate (3 steps: fp32 and bf16
# losses equal to 6 digits); at its configs' rate 1e-2 and 8 steps its loss falls by 0.2
ARCHS = {"transformer": [], "rmt": ["model.arch=rmt", "model.position=alibi", "model.dk=8",
                                    "model.dv=8", "model.rank=4", "train.lr=0.01", "train.steps=8"],
         "moe_mlp": ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=1-2", "memory.num_experts=4"],
         **{kind: [f"memory.type={kind}", "memory.placement='1:2'", "memory.key_dim=8", "memory.num_keys=8",
                   "memory.topk=4"] for kind in ("ultramem", "pkm")},
         "ultramem_v2": ["memory.type=ultramem_v2", "memory.num_heads=1", "memory.key_dim=8", "memory.num_keys=8",
                         "memory.topk=4", "memory.pre_value_dim=8"]}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_tracks_fp32(arch, cache_dir, tmp_path):
    losses = {precision: train_steps(tmp_path / f"{precision}.pt",
                                     tiny_overrides(cache_dir) + ARCHS[arch] + [f"train.precision={precision}"])["losses"]
              for precision in ("fp32", "bf16")}
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.05)
    if arch == "rmt":
        assert losses["fp32"][-1] < losses["fp32"][0] - 0.1
